"""The logits processors a request can ask for, as pure tensor functions: logit bias and penalties.

They change a row's logits before the warping of
`handler.sampler.warp_logits_to_probs`, in vLLM's order: the logit bias on the
raw logits, then the penalties (repetition, frequency, presence), then
temperature, min-p, top-k and top-p.

- logit bias (OpenAI): a number added to the logits of chosen tokens.
- presence and frequency penalties (OpenAI, vLLM): with `count` the times
  this request has generated a token so far (the prompt does not count),
  `logit -= presence * (count > 0) + frequency * count`.
- repetition penalty (Keskar et al. 2019, arXiv:1909.05858; Hugging Face's
  RepetitionPenaltyLogitsProcessor): the logit of a token in the prompt or
  the output so far is divided by r when positive, multiplied by r otherwise.

Lossless under speculation. Verify position j of a step scores the token that
follows the committed tokens and drafts 0..j-1; when those drafts are
accepted, they are the output, so plain decoding would have counted them.
Position j therefore sees the committed history plus drafts 0..j-1
(`position_counts`, `position_seen`), the way a grammar's mask does. The
target's distribution at each position is then exactly plain decoding's, and
the rejection sampler keeps the output distribution. The draft model may
apply the same to its own proposals: it needs only some distribution, and
one closer to the target's is accepted more often.

Every processor keeps a logit of -inf at -inf (r > 0, finite bias and
penalties), so they commute with a grammar's mask.

This module imports only torch (and the sampler's copy to the device, `host_to_device`: on a GPU
a copy from pageable memory would wait for the passes queued before it), and no function modifies
its inputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from handler.sampler import host_to_device

if TYPE_CHECKING:
    from handler.types import SamplingParams


def emitted_ids(token_ids: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:  # [n] long
    """The ids of `token_ids` below `vocab_size` on `device` (through pinned memory): those the model
    can emit, and so those a penalty applies to."""
    return host_to_device(torch.tensor([t for t in token_ids if t < vocab_size], dtype=torch.long), device)


def token_counts(
    token_ids: Sequence[int], vocab_size: int, device: torch.device | str | None = None
) -> torch.Tensor:  # [vocab] float32
    """How many times each token occurs in `token_ids`: a row's `base_counts` from its generated tokens.

    Ids at or past `vocab_size` (a tokenizer larger than the model's head) are
    dropped: the model cannot emit them, so their logits need no penalty.
    """
    counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
    ids = emitted_ids(token_ids, vocab_size, counts.device)
    return counts.index_add(0, ids, torch.ones(len(ids), dtype=torch.float32, device=device))


def token_mask(
    token_ids: Sequence[int], vocab_size: int, device: torch.device | str | None = None
) -> torch.Tensor:  # [vocab] bool
    """Which tokens occur in `token_ids`: a row's `seen` from its prompt and generated tokens."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    mask[emitted_ids(token_ids, vocab_size, mask.device)] = True
    return mask


def apply_logit_bias(
    logits: torch.Tensor,  # [positions, vocab]
    bias: Sequence[tuple[int, float]],
) -> torch.Tensor:  # [positions, vocab]
    """Adds each (token id, bias) to that token's logit at every position.

    The ids must be distinct (`SamplingParams` checks it). Ids at or past the
    model's vocabulary, which the tokenizer may count and the model never
    emits, are left out.
    """
    assert logits.dim() == 2, logits.shape
    vocab_size = logits.shape[-1]
    kept = [(token_id, value) for token_id, value in bias if token_id < vocab_size]
    if not kept:
        return logits
    ids = host_to_device(torch.tensor([token_id for token_id, _ in kept], dtype=torch.long), logits.device)  # [n]
    values = host_to_device(torch.tensor([value for _, value in kept], dtype=logits.dtype), logits.device)  # [n]
    return logits.index_add(-1, ids, values.expand(logits.shape[0], -1))


def _draft_pairs(num_positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(position, draft) index pairs with draft < position: position j has seen drafts 0..j-1."""
    pairs = torch.tril_indices(num_positions, num_positions - 1, offset=-1, device=device)  # [2, pairs]
    return pairs[0], pairs[1]


def position_counts(
    base_counts: torch.Tensor,  # [vocab] float: the committed generated tokens' counts
    draft_token_ids: torch.Tensor,  # [k] long
) -> torch.Tensor:  # [k + 1, vocab]
    """The generated-token counts at each of the k + 1 verify positions.

    Position j has seen the committed tokens plus drafts 0..j-1.
    """
    assert base_counts.dim() == 1 and draft_token_ids.dim() == 1, (base_counts.shape, draft_token_ids.shape)
    k = draft_token_ids.shape[0]
    counts = base_counts.unsqueeze(0).repeat(k + 1, 1)  # [k + 1, vocab]
    if k:
        positions, drafts = _draft_pairs(k + 1, base_counts.device)
        ones = torch.ones(len(positions), dtype=counts.dtype, device=counts.device)
        counts.index_put_((positions, draft_token_ids.to(counts.device)[drafts]), ones, accumulate=True)
    return counts


def position_seen(
    base_seen: torch.Tensor,  # [vocab] bool: tokens in the prompt or the committed output
    draft_token_ids: torch.Tensor,  # [k] long
) -> torch.Tensor:  # [k + 1, vocab] bool
    """`position_counts` for the repetition penalty's mask: position j adds drafts 0..j-1 to `base_seen`."""
    assert base_seen.dim() == 1 and draft_token_ids.dim() == 1, (base_seen.shape, draft_token_ids.shape)
    k = draft_token_ids.shape[0]
    seen = base_seen.unsqueeze(0).repeat(k + 1, 1)  # [k + 1, vocab]
    if k:
        positions, drafts = _draft_pairs(k + 1, base_seen.device)
        seen[positions, draft_token_ids.to(seen.device)[drafts]] = True
    return seen


def apply_penalties(
    logits: torch.Tensor,  # [positions, vocab]
    output_counts: torch.Tensor | None,  # [positions, vocab] float; None when presence = frequency = 0
    seen: torch.Tensor | None,  # [positions, vocab] bool; None when repetition = 1
    presence: float,
    frequency: float,
    repetition: float,
) -> torch.Tensor:  # [positions, vocab]
    """The repetition penalty on the seen tokens, then the frequency and presence penalties, as vLLM applies them."""
    if repetition != 1.0:
        assert seen is not None and seen.shape == logits.shape, (None if seen is None else seen.shape, logits.shape)
        # A logit of 0 stays 0 either way; Hugging Face multiplies only below 0.
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalised, logits)
    if presence != 0.0 or frequency != 0.0:
        assert output_counts is not None and output_counts.shape == logits.shape, logits.shape
        output_counts = output_counts.to(logits.dtype)
        logits = logits - frequency * output_counts - presence * (output_counts > 0).to(logits.dtype)
    return logits


def process_row_logits(
    logits: torch.Tensor,  # [positions, vocab]
    sampling: SamplingParams,
    base_counts: torch.Tensor | None,  # [vocab] float
    seen: torch.Tensor | None,  # [vocab] bool
    draft_token_ids: torch.Tensor | Sequence[int],  # [positions - 1]
) -> torch.Tensor:  # [positions, vocab] float32
    """One row's logit bias and penalties at each of its positions in a step: the engine's entry point.

    Call it for a row whose `sampling.processes_logits` is true, on the logits
    of its verify positions (target) or of its next draft (draft model, one
    position, no drafts), before `warp_logits_to_probs`. It commutes with a
    grammar's -inf mask. min_p is not here: it is warping, in
    `warp_logits_to_probs`.

    Args:
        logits: the row's logits at positions 0..positions-1: position j
            follows the committed tokens and drafts 0..j-1.
        sampling: the request's params.
        base_counts: how often each token occurs among the row's committed
            generated tokens, the prompt excluded (`token_counts`); required
            when `sampling.needs_output_counts`, else ignored.
        seen: the tokens of the prompt and the committed generated tokens
            (`token_mask`); required when `sampling.needs_seen_tokens`, else
            ignored.
        draft_token_ids: the drafts the positions follow; position j counts
            drafts 0..j-1 as generated.
    Returns:
        The processed logits in float32: a new tensor, or `logits` itself when
        it is float32 and the row asks for nothing. The inputs are left as
        they were.
    """
    assert logits.dim() == 2, logits.shape
    logits = logits.float()
    if not sampling.processes_logits:
        return logits
    drafts = torch.as_tensor(draft_token_ids, dtype=torch.long).to(logits.device)  # [positions - 1]
    assert drafts.shape == (logits.shape[0] - 1,), (drafts.shape, logits.shape)
    logits = apply_logit_bias(logits, sampling.logit_bias)
    output_counts = position_seen_mask = None
    if sampling.needs_output_counts:
        assert base_counts is not None, "presence/frequency penalty without the row's token counts"
        output_counts = position_counts(base_counts.to(logits.device), drafts)  # [positions, vocab]
    if sampling.needs_seen_tokens:
        assert seen is not None, "repetition penalty without the row's seen tokens"
        position_seen_mask = position_seen(seen.to(logits.device), drafts)  # [positions, vocab]
    return apply_penalties(
        logits,
        output_counts,
        position_seen_mask,
        sampling.presence_penalty,
        sampling.frequency_penalty,
        sampling.repetition_penalty,
    )


class _RowsRules:
    """Rows' logit bias and penalties as tensors, applied to all their positions at once (`apply`).

    Each row's result is bit for bit `process_row_logits`'s: the same operations on the same values,
    where the penalties a row does not ask for are exact identities (a repetition of 1 divides and
    multiplies by 1, a presence and frequency of 0 subtract 0, a bias of 0 is never added).
    """

    def __init__(self, params: Sequence[SamplingParams], vocab_size: int, device: torch.device) -> None:
        bias = [(row, token_id, value) for row, p in enumerate(params) for token_id, value in p.logit_bias]
        self._bias_entries = [entry for entry in bias if entry[1] < vocab_size]  # ids past the model's: no logit
        # By number of positions: the (row, position, id) index of every biased logit and its bias.
        self.bias: dict[int, tuple] = {}
        self.repetition = self.presence = self.frequency = None
        if any(p.needs_seen_tokens for p in params):
            self.repetition = _column([p.repetition_penalty for p in params], device)  # [n, 1, 1]
        if any(p.needs_output_counts for p in params):
            self.presence = _column([p.presence_penalty for p in params], device)  # [n, 1, 1]
            self.frequency = _column([p.frequency_penalty for p in params], device)  # [n, 1, 1]

    def _bias_at(self, num_positions: int, device: torch.device) -> tuple:
        entries = [(row, j, token, value) for row, token, value in self._bias_entries for j in range(num_positions)]
        rows, positions, ids, values = zip(*entries)
        index = tuple(
            host_to_device(torch.tensor(column, dtype=torch.long), device) for column in (rows, positions, ids)
        )
        self.bias[num_positions] = index, host_to_device(torch.tensor(values, dtype=torch.float32), device)
        return self.bias[num_positions]

    def apply(
        self,
        logits: torch.Tensor,  # [n, positions, vocab] float32, changed in place where it can be
        output_counts: torch.Tensor | None,  # [n, positions, vocab] float, where `presence` is set
        seen: torch.Tensor | None,  # [n, positions, vocab] bool, where `repetition` is set
    ) -> torch.Tensor:  # [n, positions, vocab] float32
        if self._bias_entries:
            num_positions = logits.shape[1]
            index, values = self.bias.get(num_positions) or self._bias_at(num_positions, logits.device)
            logits.index_put_(index, values, accumulate=True)
        if self.repetition is not None:
            penalised = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
            logits = torch.where(seen, penalised, logits)
        if self.presence is not None:
            logits = logits - self.frequency * output_counts - self.presence * (output_counts > 0).to(logits.dtype)
        return logits


def _stack(tensors: Sequence[torch.Tensor | None], vocab_size: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Rows' histories stacked [n, vocab] (a copy), zeros for a row without one."""
    return torch.stack([t if t is not None else torch.zeros(vocab_size, dtype=dtype, device=device) for t in tensors])


def _column(values: Sequence[float], device: torch.device) -> torch.Tensor:  # [n, 1, 1] float32
    return host_to_device(torch.tensor(values, dtype=torch.float32)[:, None, None], device)


def process_rows_logits(
    logits: torch.Tensor,  # [n, positions, vocab]
    params: Sequence[SamplingParams],
    base_counts: Sequence[torch.Tensor | None],  # each [vocab] float, or None (no presence/frequency)
    seen: Sequence[torch.Tensor | None],  # each [vocab] bool, or None (no repetition penalty)
    draft_token_ids: torch.Tensor,  # [n, positions - 1] long
    num_drafts: Sequence[int],
) -> torch.Tensor:  # [n, positions, vocab] float32
    """`process_row_logits` for n rows in one go: row i's positions 0..num_drafts[i] as that function
    gives them, bit for bit, its positions past them as they came (float32). Its drafts past
    num_drafts[i] (padding) count nowhere. A step's verify positions, all rows' rules in a dozen calls
    rather than a dozen a row.
    """
    assert logits.dim() == 3 and len(params) == logits.shape[0] == len(num_drafts), (logits.shape, len(params))
    raw = logits.float()
    device, (num, num_positions, vocab_size) = logits.device, logits.shape
    rules = _RowsRules(params, vocab_size, device)
    # Each row's (position, draft) pairs, position j counting drafts 0..j-1, up to its last draft's position.
    pairs = [(row, j, d) for row in range(num) for j in range(num_drafts[row] + 1) for d in range(j)]
    index = None
    if pairs:
        rows, positions, drafts = host_to_device(
            torch.tensor(list(zip(*pairs)), dtype=torch.long), device
        )  # 3 x [pairs]
        index = (rows, positions, draft_token_ids[rows, drafts])
    counts = seen_at = None
    if rules.presence is not None:
        counts = _stack(base_counts, vocab_size, torch.float32, device)[:, None].repeat(1, num_positions, 1)
        if index is not None:
            counts.index_put_(index, torch.ones(len(pairs), device=device), accumulate=True)
    if rules.repetition is not None:
        seen_at = _stack(seen, vocab_size, torch.bool, device)[:, None].repeat(1, num_positions, 1)
        if index is not None:
            seen_at[index] = True
    shaped = rules.apply(raw.clone(), counts, seen_at)
    if all(num_drafts_of == num_positions - 1 for num_drafts_of in num_drafts):
        return shaped  # every position is a row's
    last = host_to_device(torch.tensor(num_drafts)[:, None], device)  # [n, 1]: each row's last position
    kept = torch.arange(num_positions, device=device) <= last  # [n, positions]
    return torch.where(kept[..., None], shaped, raw)


class ChainPenalties:
    """Rows' logit bias and penalties over a draft model's chain of passes, kept on the device.

    Pass j of a chain gives each row the logits of its draft j, which follows its committed tokens and
    drafts 0..j-1: those drafts count as generated, as at verify position j. `apply` shapes a pass's
    logits, `add` enters the pass's drafts; nothing is read, so k passes run without a wait for the device.
    Each row's result is bit for bit `process_row_logits` at one position, the drafts so far counted as
    generated (`_RowsRules`). Rows outside `slots` are left as they are.
    """

    def __init__(
        self,
        slots: Sequence[int],
        params: Sequence[SamplingParams],
        output_counts: Sequence[torch.Tensor | None],  # each [vocab] float, or None (no presence/frequency)
        seen: Sequence[torch.Tensor | None],  # each [vocab] bool, or None (no repetition penalty)
        vocab_size: int,
        device: torch.device,
    ) -> None:
        assert slots and len(slots) == len(params) == len(output_counts) == len(seen), len(slots)
        self.slots = host_to_device(torch.tensor(list(slots), dtype=torch.long), device)  # [n]
        self.rules = _RowsRules(params, vocab_size, device)
        # The rows' histories, copies (theirs stay as they are): [n, 1, vocab].
        self.counts = self.seen = None
        if self.rules.presence is not None:
            self.counts = _stack(output_counts, vocab_size, torch.float32, device)[:, None]
        if self.rules.repetition is not None:
            self.seen = _stack(seen, vocab_size, torch.bool, device)[:, None]
        self._ones = torch.ones((len(slots), 1, 1), device=device)  # [n, 1, 1]: one more of each row's draft

    def apply(self, logits: torch.Tensor) -> torch.Tensor:  # [rows, 1, vocab] -> [rows, 1, vocab]
        """A pass's logits with the rows' bias and penalties, at the drafts entered so far (a new tensor)."""
        shaped = self.rules.apply(logits[self.slots].float(), self.counts, self.seen)  # [n, 1, vocab]
        out = logits.clone()
        out[self.slots] = shaped.to(logits.dtype)
        return out

    def add(self, drafts: torch.Tensor) -> None:  # [rows, 1] long
        """Counts the pass's drafts as generated, for the passes after it."""
        drawn = drafts[self.slots][:, :, None]  # [n, 1, 1]
        if self.counts is not None:
            self.counts.scatter_add_(2, drawn, self._ones)
        if self.seen is not None:
            self.seen.scatter_(2, drawn, True)
