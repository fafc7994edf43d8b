"""Verifying: the target's pass over every row's drafts, and the decision on them.

One target pass covers the batch: each row's pending token and its drafts, a tree's drafts
seeing their own ancestors only (`handler.tree.chunk_attention`). Each row's rules then shape
the target's logits, and the rows are decided by modified rejection sampling
(`handler.sampler.rejection_sample`), by coupling for a seeded sampled row
(`handler.sampler.coupled_targets`), or by walking a tree (`handler.tree.verify_tree`).
Nothing here drafts.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import torch

from handler.drafters import DeviceChain, DeviceDrafts
from handler.engine.row import Row
from handler.logits_processors import process_row_logits, process_rows_logits
from handler.planning.cost_table import RunningCostTable
from handler.planning.planner import Drafts
from handler.sampler import (
    HostCopy,
    SamplingBatch,
    argmax_vocab,
    coupled_targets,
    draw_step_uniforms,
    greedy_uniforms,
    greedy_verify,
    host_to_device,
    match_drafts,
    position_uniforms,
    rejection_sample,
)
from handler.tree import ROOT, chunk_attention, verify_tree


@dataclasses.dataclass(frozen=True)
class StepUniforms:
    """A step's uniforms, drawn once for the planned ks: for the draft model's draws, and for the
    verify decisions at whatever width the drafts then have (`for_verify`).

    An unseeded row draws for its own k only (`draw_step_uniforms`). A coupled row takes
    each position's own uniform, for its draft there and for the target's token there.
    """

    draft: torch.Tensor  # [batch, k]
    acceptance: torch.Tensor  # [batch, k]: draft j's acceptance uniform
    last: torch.Tensor  # [batch]: the recovered or bonus token's
    coupled: list[int]  # the slots of the coupled rows
    position: torch.Tensor  # [coupled rows, k + 1]

    @classmethod
    def draw(cls, rows: list[Row], ks: list[int], lag: int = 0) -> StepUniforms:
        """`lag`: each row's tokens drawn before these and not yet read (a coupled row's positions follow them)."""
        k = max(ks)
        if not any([row.generator is not None or row.coupled for row in rows]):
            return _greedy_step_uniforms(len(rows), k)  # greedy rows draw nothing
        draft, verify = draw_step_uniforms([row.generator for row in rows], ks, k)
        coupled = [slot for slot, row in enumerate(rows) if row.coupled]
        position = torch.zeros(len(coupled), k + 1, dtype=torch.float64)
        for index, slot in enumerate(coupled):
            row = rows[slot]
            position[index, : ks[slot] + 1] = position_uniforms(
                row.request.seed, len(row.token_ids) + lag, ks[slot] + 1
            )
            draft[slot] = position[index, :k]
        return cls(draft, verify[:, :k], verify[:, k], coupled, position)

    def for_verify(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The verify pass's uniforms where its widest row has `width` drafts: each row's acceptance
        uniforms then its last one [batch, width + 1], and the coupled rows' per position
        [coupled rows, width + 1]. Columns past a row's drafts are never read (zeros)."""
        k = self.acceptance.shape[1]
        extra = torch.zeros(self.acceptance.shape[0], max(0, width - k), dtype=torch.float64)
        verify = torch.cat([self.acceptance[:, :width], extra, self.last[:, None]], dim=1)
        position = torch.cat([self.position[:, : width + 1], extra[: len(self.coupled)]], dim=1)
        return verify, position


@functools.lru_cache(maxsize=64)
def _greedy_step_uniforms(rows: int, k: int) -> StepUniforms:
    """The uniforms of a step of greedy rows, all zeros: one per shape, shared by the steps of that shape
    (`greedy_uniforms`: only read)."""
    zeros = greedy_uniforms(rows, 2 * k + 1)
    return StepUniforms(zeros[:, :k], zeros[:, k : 2 * k], zeros[:, 2 * k], [], greedy_uniforms(0, k + 1))


@dataclasses.dataclass
class Verified:
    """A step's decisions, per row in batch order."""

    num_accepted: list[int]
    emitted: list[list[int]]  # [k + 1] each, -1 padded
    logits: torch.Tensor  # the target's raw logits [batch, k + 1, vocab] at the verified chunk columns
    paths: list[list[int]]  # the chunk columns of the pending token and accepted drafts (0, 1, ... for a chain)

    def row_logits(self, row: Row, slot: int) -> torch.Tensor | None:
        """The row's raw logits [k + 1, vocab] where it reports log-probabilities, else None."""
        return self.logits[slot] if row.logprobs is not None else None


class Verifier:
    """The target's verify pass over the batch's cache (`handler.engine.admission.Batch`), and the
    decisions on it. It times each pass, for the running cost table where the engine keeps one
    (`handler.planning.cost_table.RunningCostTable`) and for the step's record (`seconds`)."""

    def __init__(self, batch, cost_table, *, vocab_size: int, pad_token_id: int, device: torch.device) -> None:
        self.batch = batch
        self.running_costs = cost_table if isinstance(cost_table, RunningCostTable) else None
        self.vocab_size = vocab_size
        self.pad_token_id = pad_token_id
        self.device = device
        self.seconds = 0.0  # the last call's target pass; 0 where it made none

    def __call__(
        self,
        rows: list[Row],
        drafts: list[Drafts],
        uniforms: StepUniforms,
        sampling: SamplingBatch,
        logits: torch.Tensor | None = None,
    ) -> Verified:
        """Verifies one step's drafts, each row's `Drafts` as the draft loop left them, warping the target's
        logits with the step's `sampling` (the settings the draft drew with).

        Where a row's proposal is a tree, the pass gives every draft its own ancestors only, and the row
        is verified by walking the tree. `logits`: for a step without drafts, the target's logits after
        each row's pending token, already computed ([batch, 1, vocab], a prefill's): no target pass then.
        """
        self.seconds = 0.0
        ks = [row_drafts.k for row_drafts in drafts]
        batch_size, k = len(rows), max(ks)
        tree_slots = [slot for slot, row_drafts in enumerate(drafts) if row_drafts.proposal.is_tree]
        # Every row greedy and none a tree: the verdicts are argmaxes (`greedy_verify`), and neither
        # side's distributions are built. A coupled row samples, so none is here.
        greedy = sampling.all_greedy and not tree_slots
        # Drafts a draft loop left on the device are read with the verdict below (`DeviceDrafts`): until
        # then their rows' lists are empty, and nothing before the read looks at them (a row's penalties
        # take its drafts where they are; a grammar's row drafts through the loop that reads as it goes).
        on_device = _DeviceRows.of(drafts)
        # Each row's pending token leads its drafts in the verify chunk: one tensor of both.
        pending = None if logits is not None else [(row.token_ids or row.request.prompt_ids)[-1] for row in rows]
        chunk_ids, draft_token_ids, draft_probs = _draft_batch(
            drafts,
            on_device,
            k,
            self.pad_token_id,
            self.vocab_size,
            self.device,
            with_probs=not greedy,
            pending=pending,
        )
        draft_lists = [
            [] if slot in on_device.chains else list(row.proposal.token_ids) for slot, row in enumerate(drafts)
        ]

        if logits is None:
            input_ids = chunk_ids  # [batch, 1 + k]
            tree = None
            if tree_slots:
                parents = [
                    drafts[slot].proposal.parents if slot in tree_slots else list(range(ROOT, ks[slot] - 1))
                    for slot in range(batch_size)
                ]
                tree = chunk_attention(parents, k)
            logits = self._target_pass(input_ids, k + 1, tree)  # [batch, k + 1, vocab']
        else:
            assert k == 0 and logits.shape[:2] == (batch_size, 1), (k, logits.shape)
        logits = logits[..., : self.vocab_size]
        shaped = _shape_target_logits(rows, logits, draft_lists, ks, self.device, on_device.chains, draft_token_ids)
        if greedy:
            # The step's one synchronisation point: a read of the target's argmaxes (and of the drafts
            # still on the device); the verdicts and the bookkeeping after them are plain Python.
            read = functools.partial(on_device.read_with, draft_lists=draft_lists)
            num_accepted, output_token_ids = greedy_verify(shaped, draft_lists, ks, read=read)
        else:
            target_probs = sampling.warp(shaped)  # [batch, k + 1, vocab]
            verify_uniforms, coupled_uniforms = uniforms.for_verify(k)
            # Rejection sampling verifies the rows that neither couple nor walk a tree (those have
            # verdicts of their own below).
            others = set(uniforms.coupled) | set(tree_slots)
            sampled = [slot for slot in range(batch_size) if slot not in others]
            outcomes = []
            if sampled:
                index = None if len(sampled) == batch_size else torch.tensor(sampled, device=self.device)
                accepted, emitted = rejection_sample(
                    *(
                        tensor if index is None else tensor[index]
                        for tensor in (target_probs, draft_probs, draft_token_ids)
                    ),
                    torch.tensor([ks[slot] for slot in sampled], device=self.device),
                    host_to_device(verify_uniforms[sampled], self.device),
                )
                outcomes.append(torch.cat([accepted[:, None].to(emitted.dtype), emitted], dim=1).flatten())
            coupled = None
            if uniforms.coupled:
                index = torch.tensor(uniforms.coupled, device=self.device)
                coupled = coupled_targets(target_probs[index], host_to_device(coupled_uniforms, self.device))
                outcomes.append(coupled.flatten())
            # The step's one synchronisation point, one read of it all (the drafts still on the device too).
            # A chain left on the device is never a tree: its row is sampled or coupled, so outcomes has it.
            read = on_device.read_with(torch.cat(outcomes), draft_lists) if outcomes else []
            width = k + 2
            num_accepted, output_token_ids = [0] * batch_size, [[-1] * (k + 1) for _ in range(batch_size)]
            for position, slot in enumerate(sampled):
                num_accepted[slot] = read[position * width]
                output_token_ids[slot] = read[position * width + 1 : (position + 1) * width]
            if coupled is not None:
                # A coupled row's verdict: its drafts against the target's own samples.
                targets = read[len(sampled) * width :]
                verdicts = match_drafts(
                    [targets[index * (k + 1) : (index + 1) * (k + 1)] for index in range(len(uniforms.coupled))],
                    [draft_lists[slot] for slot in uniforms.coupled],
                    [ks[slot] for slot in uniforms.coupled],
                )
                for slot, num, emitted_row in zip(uniforms.coupled, *verdicts):
                    num_accepted[slot], output_token_ids[slot] = num, emitted_row
        paths = [list(range(accepted + 1)) for accepted in num_accepted]
        for slot in tree_slots:
            proposal = drafts[slot].proposal
            paths[slot], emitted = verify_tree(
                target_probs[slot], proposal.token_ids, proposal.parents, _tree_uniforms(rows[slot], k)
            )
            num_accepted[slot] = len(emitted) - 1
            output_token_ids[slot] = emitted + [-1] * (k + 1 - len(emitted))
        return Verified(num_accepted, output_token_ids, logits, paths)

    def launch_plain(
        self, rows: list[Row], uniforms: StepUniforms, sampling: SamplingBatch, input_ids: torch.Tensor
    ) -> PlainLaunch:
        """A plain step (no row drafts) whose outcome is read later: the target's pass over each row's
        pending token (`input_ids` [batch, 1], on the device: the last launch's tokens, not yet read,
        or the rows' own), and each row's next token drawn as `__call__` draws it at k = 0, left on the
        device (`PlainLaunch`). No row has a grammar, and a row's logit bias and penalties shape its
        logits from the history committed so far: the engine launches such rows only where no token of
        theirs is in flight (`handler.engine.engine._lean`, asked just before)."""
        self.seconds = 0.0
        logits = self._target_pass(input_ids, 1, None)[..., : self.vocab_size]  # [batch, 1, vocab]
        shaped = logits
        if any([row.shapes_logits for row in rows]):
            none = torch.zeros((len(rows), 0), dtype=torch.long, device=self.device)  # [batch, 0]: no drafts
            shaped = _shape_target_logits(rows, logits, [[]] * len(rows), [0] * len(rows), self.device, {}, none)
        if sampling.all_greedy:
            next_ids = argmax_vocab(shaped)  # [batch, 1]
        else:
            target_probs = sampling.warp(shaped)  # [batch, 1, vocab]
            verify_uniforms, coupled_uniforms = uniforms.for_verify(0)
            coupled = uniforms.coupled
            sampled = sorted(set(range(len(rows))) - set(coupled))
            # Index tensors through pinned memory too: nothing here waits for the passes queued before.
            next_ids = torch.empty((len(rows), 1), dtype=torch.long, device=self.device)
            if sampled:
                index = host_to_device(torch.tensor(sampled), self.device)
                no_drafts = torch.zeros((len(sampled), 0), dtype=torch.long, device=self.device)
                _, emitted = rejection_sample(
                    target_probs if len(sampled) == len(rows) else target_probs[index],
                    torch.zeros((len(sampled), 0, self.vocab_size), device=self.device),
                    no_drafts,
                    torch.zeros(len(sampled), dtype=torch.long, device=self.device),
                    host_to_device(verify_uniforms[sampled], self.device),
                )
                next_ids[index] = emitted
            if coupled:
                index = host_to_device(torch.tensor(coupled), self.device)
                next_ids[index] = coupled_targets(target_probs[index], host_to_device(coupled_uniforms, self.device))
        return PlainLaunch(next_ids, logits, HostCopy(next_ids), self.seconds)

    def _target_pass(self, input_ids: torch.Tensor, num_columns: int, tree) -> torch.Tensor:
        """Input ids [batch, 1 + k] (no padding), k + 1 columns to keep, tree mask or None -> logits
        [batch, k + 1, vocab']."""
        started = time.perf_counter()
        logits = self.batch.cache.forward(input_ids, None, logits_to_keep=num_columns, tree=tree)
        self.seconds = time.perf_counter() - started
        if self.running_costs is not None:
            self.running_costs.observe_target(len(input_ids), num_columns, self.seconds, tree=tree is not None)
        return logits


@dataclasses.dataclass(frozen=True)
class PlainLaunch:
    """A plain step launched and not yet read (`Verifier.launch_plain`)."""

    next_ids: torch.Tensor  # [batch, 1] long, on the device: each row's next token, the next pass's input
    logits: torch.Tensor  # [batch, 1, vocab]: the target's raw logits
    host: HostCopy  # next_ids on its way to the host
    seconds: float  # the target pass, as the host timed it (its launch, where the device runs behind)

    def read(self) -> Verified:
        """The step's one read: its decisions, as `Verifier.__call__` gives them at k = 0."""
        tokens = self.host.tolist()
        return Verified([0] * len(tokens), tokens, self.logits, [[0] for _ in tokens])


@dataclasses.dataclass(frozen=True)
class _DeviceRows:
    """The step's rows whose drafts a draft loop left on the device (`DeviceChain`, by slot), and their
    loops' `DeviceDrafts`: read once, with the verdict, then handed to the host (`read_with`)."""

    chains: dict[int, DeviceChain]
    holders: tuple[DeviceDrafts, ...]

    @classmethod
    def of(cls, drafts: list[Drafts]) -> _DeviceRows:
        chains = {
            slot: row.proposal.token_ids
            for slot, row in enumerate(drafts)
            if type(row.proposal.token_ids) is DeviceChain  # not isinstance: an ABC's check, once a row a step
        }
        return cls(chains, tuple({id(chain.drafts): chain.drafts for chain in chains.values()}.values()))

    def read_with(self, verdict: torch.Tensor, draft_lists: list[list[int]]) -> list:
        """One read of `verdict` (long, one or two dimensions) and of the drafts still on the device; the
        holders and `draft_lists` (each device row's entry) get their drafts. Returns `verdict` as lists."""
        if not self.holders:
            return verdict.tolist()
        read = torch.cat([verdict.flatten(), *(holder.tensor.flatten() for holder in self.holders)]).tolist()
        start = verdict.numel()
        for holder in self.holders:
            num_rows, width = holder.tensor.shape
            holder.resolve([read[start + row * width : start + (row + 1) * width] for row in range(num_rows)])
            start += num_rows * width
        for slot, chain in self.chains.items():
            draft_lists[slot] = list(chain)
        return _unflatten(read[: verdict.numel()], verdict.shape)


def _unflatten(values: list, shape: torch.Size) -> list:
    """A flat list back into nested lists of `shape` (one or two dimensions)."""
    if len(shape) == 1:
        return values
    assert len(shape) == 2, shape
    width = shape[1]
    return [values[row * width : (row + 1) * width] for row in range(shape[0])]


def _draft_batch(
    drafts: list[Drafts],
    on_device: _DeviceRows,
    k: int,
    pad_token_id: int,
    vocab_size: int,
    device: torch.device,
    *,
    with_probs: bool = True,
    pending: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The rows' drafts (on the device, padded), each led by the row's `pending` token where that is
    given (the verify chunk [batch, 1 + k]: one copy, not two and a concatenation), else [batch, k];
    the drafts alone, a view of it [batch, k]; and their draft distributions [batch, k, vocab] (None
    without `with_probs`). Host drafts are copied over;
    those a draft loop left on the device (`on_device`) are written in there, without a read: one copy
    per loop and width, not per row."""
    batch_size = len(drafts)
    padded = [
        [pad_token_id] * k if slot in on_device.chains else [*row.proposal.token_ids, *[pad_token_id] * (k - row.k)]
        for slot, row in enumerate(drafts)
    ]
    lead = 0 if pending is None else 1
    if pending is not None:
        padded = [[token, *row] for token, row in zip(pending, padded)]
    chunk_ids = host_to_device(torch.tensor(padded, dtype=torch.long).reshape(batch_size, lead + k), device)
    draft_token_ids = chunk_ids[:, lead:]  # [batch, k]: a view, written in place below
    groups: dict[tuple[int, int], tuple[DeviceDrafts, list[int], list[int]]] = {}
    for slot, chain in on_device.chains.items():
        _, slots, loop_rows = groups.setdefault((id(chain.drafts), chain.num), (chain.drafts, [], []))
        slots.append(slot)
        loop_rows.append(chain.row)
    for (_, num), (holder, slots, loop_rows) in groups.items():
        index = host_to_device(torch.tensor(loop_rows), holder.tensor.device)
        draft_token_ids[host_to_device(torch.tensor(slots), device), :num] = holder.tensor[index, :num]
    if not with_probs:
        return chunk_ids, draft_token_ids, None
    draft_probs = torch.zeros((batch_size, k, vocab_size), device=device)  # [batch, k, vocab]
    for slot, row_drafts in enumerate(drafts):
        if not row_drafts.k:
            continue
        token_ids = draft_token_ids[slot, : row_drafts.k]  # [n]
        if row_drafts.probs is not None:
            # The draft model's chain; a tree's runners-up follow it, verified by the walk.
            draft_probs[slot, : len(row_drafts.probs)] = row_drafts.probs
        else:
            # A look-up is deterministic: its draft distribution is one-hot.
            draft_probs[slot, torch.arange(len(token_ids), device=device), token_ids] = 1.0
    return chunk_ids, draft_token_ids, draft_probs


def _tree_uniforms(row: Row, k: int) -> list[float]:
    """A tree row's uniform per depth 0..k: zeros (greedy), its seed's per position, or fresh draws."""
    if row.coupled:
        return position_uniforms(row.request.seed, len(row.token_ids), k + 1).tolist()
    if row.generator is not None:
        return torch.rand(k + 1, generator=row.generator, dtype=torch.float64).tolist()
    return [0.0] * (k + 1)


def _shape_target_logits(
    rows: list[Row],
    logits: torch.Tensor,  # [batch, k + 1, vocab]
    draft_lists: list[list[int]],
    ks: list[int],
    device: torch.device,
    on_device: dict[int, object],
    draft_token_ids: torch.Tensor,  # [batch, k]
) -> torch.Tensor:  # [batch, k + 1, vocab]
    """The logits the rows' rules leave, at each row's verify positions.

    Position j of a row follows its committed tokens and drafts 0..j-1: its logit
    bias and penalties count those drafts as generated, every such row's at once
    (`process_rows_logits`, from the drafts where they are: those a chain left on the device
    (`on_device`, by slot) unread), and its grammar masks what may follow them (the host's:
    a grammar's row drafts through the loop that reads its drafts). The raw logits stay
    untouched (log-probabilities are reported from them).
    """
    shaping = [slot for slot, row in enumerate(rows) if row.shapes_logits]
    if not shaping:
        return logits
    shaped = logits.float()  # a copy for bf16 logits; float32 keeps small penalties exact
    if shaped is logits:
        shaped = logits.clone()
    penalised = [slot for slot in shaping if rows[slot].request.sampling.processes_logits]
    if len(penalised) == 1:
        # One row: its own call, without the batch's stacking and gathers (fewer calls for one).
        slot = penalised[0]
        row, num = rows[slot], ks[slot]
        shaped[slot, : num + 1] = process_row_logits(
            shaped[slot, : num + 1], row.request.sampling, row.output_counts, row.seen, draft_token_ids[slot, :num]
        )
    elif penalised:
        index = host_to_device(torch.tensor(penalised), device)
        shaped[index] = process_rows_logits(
            shaped[index],
            [rows[slot].request.sampling for slot in penalised],
            [rows[slot].output_counts for slot in penalised],
            [rows[slot].seen for slot in penalised],
            draft_token_ids[index],
            [ks[slot] for slot in penalised],
        )
    for slot in shaping:
        row, num = rows[slot], ks[slot]
        if row.grammar is not None:
            assert slot not in on_device, "a grammar's masks are the host's: its drafts were read"
            masks = row.grammar_call("masks", draft_lists[slot][:num])  # [num + 1, vocab]
            shaped[slot, : num + 1].masked_fill_(~masks.to(device), float("-inf"))
    return shaped
