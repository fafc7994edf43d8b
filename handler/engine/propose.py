"""Proposing: what each row can draft (`Proposer.options`), and the draft model's drafts (`Proposer.draft`).

Every proposal is a `handler.drafters.Proposal`: the tokens a constraint's grammar forces, a
look-up's chain or tree (n-gram, suffix, or the hybrid drafter's choice between them and the
model), or a greedy model chain widened into a tree of the draft's runners-up. The drafters are
reached by name (`handler.drafters.Drafter`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Hashable, Mapping

from handler.drafters import HYBRID, MODEL, NGRAM, NO_DRAFTS, SUFFIX, TLI, Drafter, Proposal
from handler.drafters.cross_vocab import CrossVocabDrafter
from handler.drafters.hybrid import Candidate, choose
from handler.drafters.model import DraftSample, ModelDrafter
from handler.engine.estimates import DraftConfidences, first_choice_chain
from handler.engine.plan import Planner, RowOptions, StepPlan, expected_tokens
from handler.engine.row import PROPOSER_GRAMMAR, Row
from handler.planning.cost_table import RunningCostTable
from handler.planning.planner import chain_expected_tokens, choose_runners_up
from handler.tree import chain_with_siblings

# The look-up drafters, in the order the hybrid drafter offers their candidates.
LOOKUP_DRAFTERS = (SUFFIX, NGRAM)


@dataclasses.dataclass
class DraftTimes:
    """Where the draft model's part of a step went."""

    fill_seconds: float = 0.0  # its prefill of rows drafting for the first time
    draft_seconds: float = 0.0  # its passes, with their warping and sampling
    num_passes: int = 0


def make_drafters(
    draft,
    ngram: Drafter,
    suffix: Drafter,
    *,
    draft_runner,
    vocab_size: int,
    pad_token_id: int,
    prefix_cache,
    vocab_map=None,
    cross_vocab_greedy: str = TLI,
) -> dict[str, Drafter]:
    """Every drafter by name: the look-ups, and the draft model's (for a draft from another family,
    through its vocabulary map) where there is a draft model."""
    drafters = {NGRAM: ngram, SUFFIX: suffix}
    if draft is not None and vocab_map is not None:
        drafters[MODEL] = CrossVocabDrafter(
            draft, vocab_map, vocab_map.draft_pad_token_id, prefix_cache, draft_runner, greedy=cross_vocab_greedy
        )
    elif draft is not None:
        drafters[MODEL] = ModelDrafter(draft, vocab_size, pad_token_id, prefix_cache, draft_runner)
    return drafters


class Proposer:
    """Asks the drafters, by name, for each row's proposals."""

    def __init__(
        self,
        drafters: Mapping[str, Drafter],
        planner: Planner,
        *,
        trees: bool,
        prompt_lookup_num_tokens: int = 0,
        grammar_drafts: bool = True,
    ) -> None:
        self.drafters = drafters
        self.planner = planner
        self.estimates = planner.estimates
        self.trees = trees
        self.prompt_lookup_num_tokens = prompt_lookup_num_tokens
        self.grammar_drafts = grammar_drafts

    def options(self, rows: list[Row]) -> list[RowOptions]:
        """What each row can draft this step: its best look-up and, where it may, the draft model.

        A constrained row first takes the tokens its grammar forces (free one-hot drafts);
        otherwise its look-ups are cut at the first token the grammar refuses. A hybrid
        row offers its most promising look-up (`handler.drafters.hybrid`) and the draft
        model; the plan picks between them with the batch's costs (`handler.engine.plan`). A row
        whose logits no rule shapes may take a tree of look-up candidates (`handler.tree`).
        """
        options = []
        step_seconds = self.planner.step_seconds(len(rows))
        for row in rows:
            cap = row.lookup_cap(self.prompt_lookup_num_tokens)
            forced = []
            if row.grammar is not None and cap and self.grammar_drafts:
                forced = row.grammar_call("forced_tokens", cap)
            model_curve = None
            if row.drafter in (MODEL, HYBRID) and not forced:
                model_curve = self.estimates.tracker(row, MODEL).expected_curve(row.cap())
            if forced:
                curve = self.estimates.tracker(row, PROPOSER_GRAMMAR).expected_curve(len(forced))
                options.append(RowOptions(Proposal(forced), PROPOSER_GRAMMAR, curve, None, None, None, None))
                continue
            tree = self.trees and row.request.speculative_tree is not False and not row.shapes_logits
            candidates = []
            for name in LOOKUP_DRAFTERS:
                if row.drafter not in (name, HYBRID):
                    continue
                lookup = self.drafters[name].lookup(row.request_id, cap, tree=tree)
                if lookup.token_ids and row.grammar is not None:
                    lookup = lookup.prefix(row.grammar_call("num_valid", lookup.token_ids))
                if row.drafter == name or lookup.token_ids:
                    lookup, curve = self.estimates.estimate(row, name, lookup)
                    candidates.append(Candidate(name, lookup, len(lookup.token_ids), curve))
            guesses = self.planner.guesses_for(row)
            if not candidates:
                options.append(RowOptions(NO_DRAFTS, None, [1.0], None, None, model_curve, guesses))
                continue
            best = choose(candidates, step_seconds)
            chain, chain_curve = None, None
            if best.lookup.is_tree:
                chain, chain_curve = first_choice_chain(best.lookup, best.curve)
            options.append(
                RowOptions(best.lookup, best.proposer, list(best.curve), chain, chain_curve, model_curve, guesses)
            )
        return options

    def draft(self, rows: list[Row], plan: StepPlan, draft_uniforms) -> DraftTimes:
        """Runs the draft model for the rows the plan has it draft (`draft_uniforms`: [batch, k], each
        row's uniforms for its draws), and puts its drafts into their `RowPlan`s.

        The draft model may stop before a row's k (`plan.keep_drafting`): the row's k is lowered to the
        drafts drawn. A greedy row's chain may take the draft's runners-up as siblings
        (`_add_runners_up`): its proposal becomes that tree and its k the tree's size.
        """
        times = DraftTimes()
        model_slots = [slot for slot, row_plan in enumerate(plan.rows) if row_plan.uses_model and row_plan.k > 0]
        if not model_slots:
            return times
        drafter = self.drafters[MODEL]
        cost_table = self.planner.cost_table
        started = time.perf_counter()
        drafter.fill([rows[slot].request_id for slot in model_slots])
        times.fill_seconds = time.perf_counter() - started
        started = time.perf_counter()
        samples = drafter.propose(
            {
                rows[slot].request_id: (
                    rows[slot].request.sampling.temperature,
                    rows[slot].request.sampling.top_k,
                    rows[slot].request.sampling.top_p,
                    draft_uniforms[slot, : plan.rows[slot].k],
                )
                for slot in model_slots
            },
            shapers={
                rows[slot].request_id: rows[slot].shape_draft_logits for slot in model_slots if rows[slot].shapes_logits
            },
            keep_drafting=plan.keep_drafting,
            # Confidences serve the stop rule and the runners-up, both planned from a cost table.
            with_confidence=cost_table is not None,
            guesses=self._draft_guesses(rows, model_slots),
        )
        by_slot = {slot: samples[rows[slot].request_id] for slot in model_slots}
        times.draft_seconds = time.perf_counter() - started
        times.num_passes = drafter.last_num_passes
        if isinstance(cost_table, RunningCostTable):
            # Every row of the draft's batch takes part in every pass.
            cost_table.observe_draft(drafter.num_rows, times.num_passes, times.draft_seconds)
        for slot, sample in by_slot.items():
            row, row_plan = rows[slot], plan.rows[slot]
            if self.planner.guesses_for(row) is not None:
                passes_needed = drafter.passes_needed(row.request_id, len(sample.token_ids))
                row.guess_rate.update(len(sample.token_ids), passes_needed)
            row.end_drafting()
            row_plan.k = num = min(row_plan.k, len(sample.token_ids))
            row.stats.draft_passes += drafter.passes_needed(row.request_id, num)
            row_plan.sample = sample.token_ids[:num], sample.probs[:num]
            if sample.confidences:
                row_plan.confidences = DraftConfidences(sample.confidences[:num])
        self._add_runners_up(rows, plan, by_slot)
        return times

    def _draft_guesses(self, rows: list[Row], model_slots: list[int]) -> dict[Hashable, Callable]:
        """Per hybrid row drafting with the model: its suffix trees' guess of the draft model's next drafts."""
        return {
            rows[slot].request_id: functools.partial(self.drafters[SUFFIX].continuation, rows[slot].request_id)
            for slot in model_slots
            if self.planner.guesses_for(rows[slot]) is not None
        }

    def _takes_runners_up(self, row: Row) -> bool:
        """Whether a greedy model row's chain may take the draft's runners-up as siblings (`handler.tree`).

        Greedy only: for a sampled row, rejection sampling of the chain accepts more than a
        walk of the tree could (it accepts min(p, q) summed over the vocabulary).
        """
        return (
            self.trees
            and self.planner.cost_table is not None
            and row.request.sampling.is_greedy
            and row.request.speculative_tree is not False
            and not row.shapes_logits
        )

    def _add_runners_up(self, rows: list[Row], plan: StepPlan, samples: dict[int, DraftSample]) -> None:
        """Turns greedy model chains into trees where the draft's runners-up pay (`choose_runners_up`)."""
        plans = plan.rows
        slots = [slot for slot in samples if self._takes_runners_up(rows[slot]) and samples[slot].runners_up]
        if not slots:
            return
        batch_size = len(rows)
        num_draft_passes = max(plans[slot].k for slot in samples)
        calibrations = self.estimates.calibrations
        # Each model row's calibrated acceptance of each of its drafts, and the step's expected tokens.
        chain_acceptances = {
            slot: [
                calibrations[rows[slot].request.sampling.is_greedy].acceptance(confidence)
                for confidence in plans[slot].confidences.confidences
            ]
            for slot in samples
        }
        tokens = expected_tokens(plans, [slot for slot in range(batch_size) if slot not in samples])
        tokens += sum(chain_expected_tokens(acceptances) for acceptances in chain_acceptances.values())
        runner_up_acceptances, shares = [], []
        for slot in slots:
            # The runner-up's share of what the draft left to tokens other than its draft.
            row_shares = [
                prob / max(1.0 - c, 1e-6)
                for (_, prob), c in zip(samples[slot].runners_up, plans[slot].confidences.confidences)
            ]
            shares.append(row_shares)
            runner_up_acceptances.append(
                [self.estimates.runner_up_calibration.acceptance(share) for share in row_shares]
            )

        def step_seconds(width: int) -> float:
            return self.planner.pass_seconds(batch_size, width, num_draft_passes)

        max_nodes = [max(plans[slot].k, rows[slot].lookup_cap(self.prompt_lookup_num_tokens)) for slot in slots]
        acceptances = [chain_acceptances[slot] for slot in slots]
        chosen = choose_runners_up(acceptances, runner_up_acceptances, max_nodes, plan.width, tokens, step_seconds)
        for slot, positions, row_shares in zip(slots, chosen, shares):
            if not positions:
                continue
            runners_up = samples[slot].runners_up
            token_ids, parents = chain_with_siblings(
                samples[slot].token_ids[: plans[slot].k].tolist(),
                positions,
                [runners_up[position][0] for position in positions],
            )
            plans[slot].proposal = Proposal(token_ids, parents=parents)
            plans[slot].k = len(token_ids)
            plans[slot].confidences.runner_up_shares = {position: row_shares[position] for position in positions}
