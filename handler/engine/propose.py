"""Proposing: what each row can draft (`Proposer.options`), and the drafts of the plan (`Proposer.draft`).

Every proposal is a `handler.drafters.Proposal`: the tokens a constraint's grammar forces, a
look-up's chain or tree (n-gram, suffix), or the draft model's chain, widened into a tree of the
draft's runners-up where they pay. The plan (`handler.planning.planner`) picks among them; what
each row then verifies is its `Drafts`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Mapping

from handler.drafters import (
    LOOKUPS,
    MODEL,
    NGRAM,
    NO_DRAFTS,
    PROPOSER_GRAMMAR,
    SUFFIX,
    TLI,
    Drafter,
    DraftRow,
    Proposal,
    drafters_of,
)
from handler.drafters.cross_vocab import CrossVocabDrafter
from handler.drafters.grammar import GrammarDrafter
from handler.drafters.model import ModelDrafter
from handler.engine.row import Row
from handler.planning.acceptance import DraftConfidences
from handler.planning.cost_table import RunningCostTable
from handler.planning.planner import NO_DRAFTS_TO_VERIFY, Candidate, Drafts, Planner, RowOptions, StepPlan
from handler.sampler import SamplingBatch
from handler.tree import chain_with_siblings
from handler.types import DrafterName


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
    draft_prefill=None,
    draft_prefill_speedup: float = 1.0,
) -> dict[DrafterName, Drafter]:
    """Every drafter by name: the look-ups, the grammar, and the draft model's (for a draft from another
    family, through its vocabulary map) where there is a draft model. The draft model takes its guesses
    from the suffix trees (guessed drafting), with a shared vocabulary only. `draft_prefill`: the form
    of the draft that prefills its rows (`LoadedModels.draft_prefill`), or None, and how much faster it
    prefilled than the draft (`draft_prefill_speedup`)."""
    forms = {"prefill_model": draft_prefill, "prefill_speedup": draft_prefill_speedup}
    drafters = {NGRAM: ngram, SUFFIX: suffix, PROPOSER_GRAMMAR: GrammarDrafter()}
    if draft is not None and vocab_map is not None:
        drafters[MODEL] = CrossVocabDrafter(
            draft, vocab_map, prefix_cache, draft_runner, greedy=cross_vocab_greedy, **forms
        )
    elif draft is not None:
        drafters[MODEL] = ModelDrafter(
            draft, vocab_size, pad_token_id, prefix_cache, draft_runner, guesser=suffix, **forms
        )
    return drafters


class Proposer:
    """Asks the drafters for each row's proposals, every drafter through `propose`."""

    def __init__(
        self,
        drafters: Mapping[DrafterName, Drafter],
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

    def options(self, rows: list[Row], sampling: SamplingBatch) -> list[RowOptions]:
        """What each row can draft this step: its look-ups' candidates and, where it may, the draft model.

        A constrained row first takes the tokens its grammar forces (free one-hot drafts);
        otherwise its look-ups are cut at the first token the grammar refuses. A hybrid row
        offers every look-up that found something and the draft model; the plan picks
        (`handler.planning.planner.Planner.plan`). A row whose logits no rule shapes may take a
        tree of look-up candidates (`handler.tree`).
        """
        self.planner.reprice_guesses()
        caps = [row.lookup_cap(self.prompt_lookup_num_tokens) for row in rows]
        proposing = [drafters_of(row.drafter) for row in rows]
        forced = [NO_DRAFTS] * len(rows)
        if self.grammar_drafts:
            asking = [
                DraftRow(row.request_id, cap, slot, forced=functools.partial(row.grammar_call, "forced_tokens"))
                for slot, (row, cap) in enumerate(zip(rows, caps))
                if row.grammar is not None and cap
            ]
            forced = self._proposals(PROPOSER_GRAMMAR, asking, sampling, forced)
        lookups = {}
        for name in LOOKUPS:
            asking = [
                DraftRow(row.request_id, cap, slot, tree=self._takes_trees(row))
                for slot, (row, cap) in enumerate(zip(rows, caps))
                if name in proposing[slot] and not forced[slot].token_ids
            ]
            lookups[name] = self._proposals(name, asking, sampling, [None] * len(rows))
        options = []
        for slot, row in enumerate(rows):
            if forced[slot].token_ids:
                num = len(forced[slot].token_ids)
                curve = self.estimates.tracker(row, PROPOSER_GRAMMAR).expected_curve(num)
                grammar = Candidate(drafter=PROPOSER_GRAMMAR, lookup=forced[slot], max_k=num, curve=curve)
                options.append(RowOptions(candidates=(grammar,)))
                continue
            model_curve = None
            if MODEL in proposing[slot]:
                model_curve = self.estimates.tracker(row, MODEL).expected_curve(row.cap())
            candidates = []
            for name in LOOKUPS:
                lookup = lookups[name][slot]
                if lookup is None:
                    continue
                if lookup.token_ids and row.grammar is not None:
                    lookup = lookup.prefix(row.grammar_call("num_valid", lookup.token_ids))
                if row.drafter == name or lookup.token_ids:
                    lookup, curve = self.estimates.estimate(row, name, lookup)
                    candidates.append(Candidate(drafter=name, lookup=lookup, max_k=len(lookup.token_ids), curve=curve))
            guesses = self.planner.guesses_for(row, len(rows))
            options.append(RowOptions(candidates=tuple(candidates), model_curve=model_curve, guesses=guesses))
        return options

    def _proposals(self, name: DrafterName, asking: list[DraftRow], sampling: SamplingBatch, default: list) -> list:
        """Per row of the step, the proposal of drafter `name` where the row asked it, else `default`'s."""
        proposals = list(default)
        if asking:
            for row, proposal in zip(asking, self.drafters[name].propose(asking, sampling)):
                proposals[row.slot] = proposal
        return proposals

    def _takes_trees(self, row: Row) -> bool:
        """Whether a row's look-ups may propose trees: where its logits no rule shapes."""
        return self.trees and row.request.speculative_tree is not False and not row.shapes_logits

    def draft(self, rows: list[Row], plan: StepPlan, sampling: SamplingBatch) -> tuple[list[Drafts], DraftTimes]:
        """Each row's drafts for the plan: its look-up's as planned, or the draft model's, which it runs
        for the rows the plan has it draft (`sampling.uniforms`: [batch, k], each row's uniforms for its draws).

        The draft model may stop before a row's k (`plan.keep_drafting`): the row then verifies the
        drafts drawn. A greedy row's chain may take the draft's runners-up as siblings (`_runners_up`):
        it then verifies that tree.

        Returns:
            per row in batch order, what it verifies; and where the draft model's time went.
        """
        times = DraftTimes()
        # A row without drafts (a plain plan's) verifies the one shared NO_DRAFTS_TO_VERIFY.
        drafts = [
            NO_DRAFTS_TO_VERIFY if row_plan.uses_model or row_plan.proposal is NO_DRAFTS else Drafts(row_plan.proposal)
            for row_plan in plan.rows
        ]
        model_slots = [slot for slot, row_plan in enumerate(plan.rows) if row_plan.uses_model and row_plan.k > 0]
        if not model_slots:
            return drafts, times
        drafter = self.drafters[MODEL]
        cost_table = self.planner.cost_table
        filling = sum([drafter.unfilled_tokens(rows[slot].request_id) for slot in model_slots])
        started = time.perf_counter()
        drafter.fill([rows[slot].request_id for slot in model_slots])
        times.fill_seconds = time.perf_counter() - started
        if filling and isinstance(cost_table, RunningCostTable):
            cost_table.observe_fill(filling, times.fill_seconds)
        started = time.perf_counter()
        # Confidences serve the stop rule and the runners-up, both planned from a cost table, and only
        # those: measured, they are read before the verify pass (the stop and the tree are the host's), a
        # second wait for the device in the step; without them the drafts stay there into the verify.
        measure_confidence = cost_table is not None and (
            plan.keep_drafting is not None or any(self._takes_runners_up(rows[slot]) for slot in model_slots)
        )
        asking = [
            DraftRow(
                rows[slot].request_id,
                plan.rows[slot].k,
                slot,
                shape=rows[slot].shape_draft_logits if rows[slot].shapes_logits else None,
                penalties=rows[slot].draft_penalties() if rows[slot].shapes_logits else None,
                guesses=self.planner.guess_width(rows[slot], len(rows)) if plan.rows[slot].guesses else 0,
                measure_confidence=measure_confidence,
            )
            for slot in model_slots
        ]
        proposals = drafter.propose(asking, sampling, keep_drafting=plan.keep_drafting)
        times.draft_seconds = time.perf_counter() - started
        times.num_passes = drafter.last_num_passes
        if isinstance(cost_table, RunningCostTable):
            # Every row of the draft's batch takes part in every pass.
            cost_table.observe_draft(drafter.num_rows, times.num_passes, times.draft_seconds)
        chains = {}
        for slot, asked, proposal in zip(model_slots, asking, proposals):
            row = rows[slot]
            drawn = len(proposal.token_ids)
            num = min(plan.rows[slot].k, drawn)
            passes = drafter.passes_needed(row.request_id, num)
            if asked.guesses:  # its passes carried guesses (`_guesses`: 0 where it takes none)
                row.guess_rate.update(drawn, passes if num == drawn else drafter.passes_needed(row.request_id, drawn))
            row.end_drafting()
            row.stats.draft_passes += passes
            chain = proposal if num == drawn else proposal.prefix(num)
            chains[slot] = (num, chain.confidences or [], chain.runners_up or [])
            confidences = DraftConfidences(chain.confidences) if chain.confidences else None
            # The chain as drawn: its draft measures stay on it, unread (`Drafts` holds what verifying reads).
            drafts[slot] = Drafts(chain, probs=chain.draft_probs, confidences=confidences)
        for slot, (positions, shares) in self._runners_up(rows, plan, chains).items():
            chain = drafts[slot]
            runners_up = chains[slot][2]
            token_ids, parents = chain_with_siblings(
                chain.proposal.token_ids, positions, [runners_up[position][0] for position in positions]
            )
            confidences = dataclasses.replace(chain.confidences, runner_up_shares=shares)
            drafts[slot] = Drafts(Proposal(token_ids, parents=parents), probs=chain.probs, confidences=confidences)
        return drafts, times

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

    def _runners_up(self, rows: list[Row], plan: StepPlan, chains: dict) -> dict[int, tuple[list[int], dict]]:
        """The greedy model chains that take the draft's runners-up, where they pay (`Planner.runners_up`)."""
        eligible = [slot for slot, chain in chains.items() if chain[2] and self._takes_runners_up(rows[slot])]
        if not eligible:
            return {}
        max_nodes = [max(chains[slot][0], rows[slot].lookup_cap(self.prompt_lookup_num_tokens)) for slot in eligible]
        return self.planner.runners_up(rows, plan.rows, chains, eligible, max_nodes)
