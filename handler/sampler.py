"""Modified rejection sampling for speculative decoding, as pure tensor functions.

Vocabulary, used throughout the package (Leviathan et al. 2023, arXiv:2211.17192;
Chen et al. 2023, arXiv:2302.01318):

- draft: the small model. It proposes `k` draft tokens, each sampled from
  `draft_probs`, its distribution after the request's sampling settings (`SamplingBatch`).
- target: the large model. One forward pass over the drafts gives
  `target_probs` at k + 1 positions, after the same transforms.
- accepted: draft token x at position j is kept with probability
  min(1, target_probs[x] / draft_probs[x]); the first rejection ends the run.
- recovered: the token sampled after the first rejection, from the residual
  norm(max(0, target_probs - draft_probs)) at the rejected position.
- bonus: when all k drafts are accepted, one more token sampled from
  target_probs at position k + 1.

The output follows the target's distribution exactly. Greedy decoding
(temperature 0) is the same algorithm on one-hot distributions: a draft token
is accepted iff it is the target's argmax, and the recovered or bonus token is
the target's argmax.

Seeded requests are verified by coupling instead: every output position has
its own uniform, keyed by the request's seed and the position alone
(`position_uniforms`). The target's token at a position is its inverse-CDF
sample of target_probs with that uniform; the draft token there is the
inverse-CDF sample of draft_probs with the same uniform, and drafts are
accepted while they equal the target's tokens (`coupled_targets`, then
`match_drafts`). Every
emitted token is then the target's own sample for its position, whatever was
drafted: the output follows the target's distribution exactly and depends on
the seed and the target alone, not on k, the drafter or the batch (the idea of
drafter-invariant speculative decoding: Daliri, Musco and Suresh, "Coupling
without Communication and Drafter-Invariant Speculative Decoding", 2024). The
price is a little acceptance: a draft matches less often than rejection
sampling accepts it, since the two inverse CDFs need not line up token for
token.

A step's sampling settings travel as one `SamplingBatch` of tensors, made once per step and read
by the draft model's draws and by the verify pass alike.

This module imports only torch (and numpy, for one CPU argmax) and holds no randomness of its own: callers
pass uniforms drawn from per-request generators (`draw_step_uniforms`) or
derived from a seed (`position_uniforms`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple, Sequence

import numpy
import torch

ARGMAX_BLOCK = 512  # entries a block in `argmax_vocab` on a CPU
ARGMAX_MIN_BLOCKS = 8  # fewer blocks than this: the plain argmax
NUMPY_ARGMAX_MAX_VALUES = 1 << 20  # up to this many float32/float64 values: numpy's argmax on a CPU
_NUMPY_ARGMAX_DTYPES = (torch.float32, torch.float64)
TOP_P_PREFIX = 256  # likeliest tokens read first for top-p on a CPU (`_apply_top_p`)
SAMPLE_BLOCK = 256  # tokens a block in `sample_from_probs`


def argmax_vocab(values: torch.Tensor) -> torch.Tensor:  # [..., vocab] -> [...] long
    """`values.argmax(dim=-1)`: each row's first index of its largest value (NaN counting as the
    largest, as argmax counts it), bit for bit.

    On a CPU, torch's argmax over a vocabulary is a scalar loop, about ten times slower than `amax`
    (2.9 ms against 0.26 ms for 16 rows of 151,936 float32 logits, 2 cores): on a real vocabulary the
    argmaxes of a greedy drafting step cost as much as a draft pass. So by blocks: each block's `amax`
    (vectorised), the first block holding the row's largest (an argmax over the few block maxima),
    and the argmax within that block. Earlier blocks hold only smaller values, so the index is the
    first; a NaN makes its block's maximum NaN, which the argmax over blocks takes first, as argmax
    would. On other devices, the plain argmax; for small vocabularies, `max` (below).

    Fewer values than that (up to NUMPY_ARGMAX_MAX_VALUES, float32 or float64: a draft pass's or a
    verify pass's logits over a few rows) go to numpy's argmax, the same index (the first largest, a
    NaN first) from one vectorised scan without torch's per-call cost: 4 against 28 us for 16 rows
    of 384, 21 against 80 us for one row of 151,936 (2 cores). Past that, torch's threads win.
    """
    if values.device.type != "cpu":
        return values.argmax(dim=-1)
    if values.dtype in _NUMPY_ARGMAX_DTYPES and values.numel() <= NUMPY_ARGMAX_MAX_VALUES:
        return torch.from_numpy(numpy.asarray(values.detach().numpy().argmax(axis=-1)))
    vocab = values.shape[-1]
    num_blocks = vocab // ARGMAX_BLOCK
    if num_blocks < ARGMAX_MIN_BLOCKS:
        # A small vocabulary: over several rows, `max`'s indices (the first of the largest, a NaN
        # first, as argmax's) take half argmax's time (38 against 85 us for 16 x 5 x 384); over one
        # row, argmax is the faster.
        return values.max(dim=-1).indices if values[..., 0].numel() > 1 else values.argmax(dim=-1)
    body = values[..., : num_blocks * ARGMAX_BLOCK].unflatten(-1, (num_blocks, ARGMAX_BLOCK))  # [..., blocks, block]
    block_max = body.amax(dim=-1)  # [..., blocks]
    if num_blocks * ARGMAX_BLOCK < vocab:  # the tail, a shorter block of its own
        block_max = torch.cat([block_max, values[..., num_blocks * ARGMAX_BLOCK :].amax(dim=-1, keepdim=True)], dim=-1)
    first = block_max.argmax(dim=-1, keepdim=True) * ARGMAX_BLOCK  # [..., 1]: the block's first index
    # The tail's block reaches past the vocabulary: its indices are clamped to the last, which repeats
    # the last entry after the tail's own and never comes first.
    index = (first + torch.arange(ARGMAX_BLOCK, device=values.device)).clamp(max=vocab - 1)  # [..., block]
    return (first + values.gather(-1, index).argmax(dim=-1, keepdim=True))[..., 0]


@dataclasses.dataclass(frozen=True)
class InUse:
    """What the host knows of a batch's settings without reading its tensors, so that a warp runs only
    the paths and filters some row may use. Each flag is an upper bound: False means no row uses it."""

    greedy: bool  # some row is greedy
    sampled: bool  # some row samples
    max_top_k: int  # the largest top-k of any row, greedy ones included (0: no row filters)
    top_p: bool  # some sampled row uses top-p
    min_p: bool  # some sampled row uses min-p

    @classmethod
    def of(cls, params: Sequence) -> InUse:
        sampled = [p for p in params if p.temperature > 0]
        return cls(
            greedy=len(sampled) < len(params),
            sampled=bool(sampled),
            max_top_k=max([p.top_k for p in params], default=0),
            top_p=any(p.top_p < 1.0 for p in sampled),
            min_p=any(p.min_p > 0 for p in sampled),
        )


class _Greedy(NamedTuple):
    """The settings of a row that draws greedily (`SamplingBatch.select`'s rows without a slot)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0


_GREEDY = _Greedy()


@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """A step's sampling settings, one row per request in batch order (`from_params`): the draft model
    samples with them (`select` puts them in its cache's row order) and the verify pass warps the
    target's logits with them (`warp`). Their tensors are built when first read: a batch whose rows
    are all greedy draws and verifies by argmaxes, and never reads them."""

    # Per row, an object with temperature, top_k, top_p and min_p (`handler.types.SamplingParams`).
    params: tuple
    device: torch.device
    # [batch, k] float64 on the CPU: each row's uniforms for its draft draws, once the step's plan has
    # drawn them (`with_uniforms`); None before.
    uniforms: torch.Tensor | None = None
    # What the host knows of the settings (`from_params`); None: unknown, every path and filter runs.
    in_use: InUse | None = None

    @classmethod
    def from_params(cls, params: Sequence, device: torch.device) -> SamplingBatch:
        """The batch of each row's settings (`params`: objects with temperature, top_k, top_p and min_p,
        `handler.types.SamplingParams`)."""
        return cls(tuple(params), device, in_use=InUse.of(params))

    @functools.cached_property
    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        # Through pinned memory: a copy from pageable memory waits for the passes queued before it.
        return (
            host_to_device(torch.tensor([p.temperature for p in self.params]), self.device),
            host_to_device(torch.tensor([p.top_k for p in self.params]), self.device),
            host_to_device(torch.tensor([p.top_p for p in self.params]), self.device),
            host_to_device(torch.tensor([p.min_p for p in self.params]), self.device),
        )

    @property
    def temperature(self) -> torch.Tensor:  # [batch] float, 0 means greedy
        return self._tensors[0]

    @property
    def top_k(self) -> torch.Tensor:  # [batch] long, 0 means off
        return self._tensors[1]

    @property
    def top_p(self) -> torch.Tensor:  # [batch] float, 1.0 means off
        return self._tensors[2]

    @property
    def min_p(self) -> torch.Tensor:  # [batch] float, 0 means off
        return self._tensors[3]

    @property
    def all_greedy(self) -> bool:
        """Whether the host knows that no row samples: draws and verdicts are then argmaxes."""
        return self.in_use is not None and not self.in_use.sampled

    def with_uniforms(self, uniforms: torch.Tensor) -> SamplingBatch:  # [batch, k] float64
        return dataclasses.replace(self, uniforms=uniforms)

    def select(self, slots: Sequence[int | None], num_uniforms: Sequence[int], width: int) -> SamplingBatch:
        """The settings of another order of rows: row i takes this batch's row `slots[i]`, and the first
        `num_uniforms[i]` of its uniforms (zeros after them, up to `width`); a row whose slot is None
        samples greedily (its draws are never verified)."""
        if self.uniforms is None or self.all_greedy:  # greedy: zeros
            uniforms = greedy_uniforms(len(slots), width)
        else:
            uniforms = torch.zeros((len(slots), width), dtype=torch.float64)  # [rows, width]
            for row, (slot, num) in enumerate(zip(slots, num_uniforms)):
                if slot is not None:
                    uniforms[row, :num] = self.uniforms[slot, :num]
        return SamplingBatch(
            tuple([_GREEDY if slot is None else self.params[slot] for slot in slots]),
            self.device,
            uniforms,
            # A row without a slot is greedy.
            self.in_use if self.in_use is None or None not in slots else dataclasses.replace(self.in_use, greedy=True),
        )

    def warp(self, logits: torch.Tensor) -> torch.Tensor:  # [batch, positions, vocab]
        """`warp_logits_to_probs` with these settings: probabilities [batch, positions, vocab]."""
        return warp_logits_to_probs(logits, self.temperature, self.top_k, self.top_p, self.min_p, in_use=self.in_use)


def warp_logits_to_probs(
    logits: torch.Tensor,  # [batch, positions, vocab]
    temperature: torch.Tensor,  # [batch] float, 0 means greedy
    top_k: torch.Tensor,  # [batch] long, 0 means off
    top_p: torch.Tensor,  # [batch] float, 1.0 means off
    min_p: torch.Tensor | None = None,  # [batch] float, 0 means off
    *,
    in_use: InUse | None = None,
) -> torch.Tensor:
    """Applies temperature, then min-p, top-k and top-p, row by row, and returns probabilities.

    Greedy rows get the one-hot distribution of their argmax, so the same
    rejection sampler serves greedy and sampled requests in one batch.
    What the host knows (`in_use`; None: unknown) spares work, never a row's result.

    Returns:
        probs: [batch, positions, vocab] float32, each row summing to 1.
    """
    assert logits.dim() == 3, logits.shape
    logits = logits.float()
    # Every row takes both paths and `torch.where` keeps its own: no branch on a tensor's value,
    # so the host never waits for the device here. A row's result is its own path's, bit for bit.
    greedy = temperature == 0  # [batch]
    if in_use is None or in_use.greedy:
        one_hot = torch.zeros_like(logits).scatter_(-1, argmax_vocab(logits)[..., None], 1.0)
        if in_use is not None and not in_use.sampled:
            return one_hot
    # Shift by the max before dividing: a tiny temperature would overflow logits / t to inf, then NaN.
    # A greedy row divides by 1, so that its unused path stays finite.
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    scaled = shifted / torch.where(greedy, 1.0, temperature).to(logits.dtype)[:, None, None]
    if min_p is not None and (in_use is None or in_use.min_p):
        scaled = _apply_min_p(scaled, min_p)
    scaled = _apply_top_k(scaled, top_k, None if in_use is None else in_use.max_top_k)
    if in_use is None or in_use.top_p:
        scaled = _apply_top_p(scaled, top_p)
    probs = torch.softmax(scaled, dim=-1)
    if in_use is not None and not in_use.greedy:
        return probs
    return torch.where(greedy[:, None, None], one_hot, probs)


def _apply_min_p(
    logits: torch.Tensor,  # [rows, positions, vocab], after temperature
    min_p: torch.Tensor,  # [rows]
) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    # As Hugging Face's MinPLogitsWarper: below min_p times the top probability goes; the top
    # token itself always stays, since min_p <= 1. A row without min-p has threshold 0: nothing goes.
    threshold = min_p.to(probs.dtype)[:, None, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _apply_top_k(
    logits: torch.Tensor,  # [rows, positions, vocab]
    top_k: torch.Tensor,  # [rows]
    max_top_k: int | None = None,
) -> torch.Tensor:
    """`max_top_k`: a bound on `top_k` known on the host (0: no row filters); None reads it."""
    vocab_size = logits.shape[-1]
    if max_top_k is None:
        max_top_k = int(top_k.max())
    max_top_k = min(max_top_k, vocab_size)
    if max_top_k <= 0:
        return logits
    top_k = top_k.clamp(max=vocab_size)
    active = top_k > 0
    kth_largest = logits.topk(max_top_k, dim=-1).values  # [rows, positions, max_top_k]
    # Rows without top-k use index 0 but are left unmasked below.
    index = (top_k.clamp(min=1) - 1)[:, None, None].expand(-1, logits.shape[1], 1)
    threshold = kth_largest.gather(-1, index)  # [rows, positions, 1]
    # Ties with the k-th value are kept, as in Hugging Face's TopKLogitsWarper.
    remove = (logits < threshold) & active[:, None, None]
    return logits.masked_fill(remove, float("-inf"))


def _apply_top_p(
    logits: torch.Tensor,  # [rows, positions, vocab]
    top_p: torch.Tensor,  # [rows]
) -> torch.Tensor:
    """Keeps, at each position of a row with top-p, the likeliest tokens whose mass before them is
    below top_p (the top token always).

    A position's nucleus is read from its probabilities in descending order. On a CPU a sort over a
    real vocabulary is slow (160 ms for 16 rows of 151,936 tokens on 2 cores, against 7.5 ms for their
    top 256), and a nucleus is mostly far smaller: so the top TOP_P_PREFIX come first, and only the
    positions whose nucleus may reach past them are sorted whole. Both paths read the same
    probabilities in the same order, so a position's result depends neither on the path nor on the
    batch it came in.
    """
    active = (top_p < 1.0)[:, None, None]  # [rows, 1, 1]
    threshold = top_p.to(logits.dtype)[:, None, None]  # [rows, 1, 1]
    probs = logits.softmax(dim=-1)  # [rows, positions, vocab]
    if logits.device.type != "cpu" or probs.shape[-1] <= TOP_P_PREFIX:
        return logits.masked_fill(outside_nucleus_by_sort(probs, threshold) & active, float("-inf"))
    values, order = probs.topk(TOP_P_PREFIX, dim=-1)  # [rows, positions, prefix], descending
    removed = _outside_nucleus(values, threshold) & active
    # Past the prefix every token of a row with top-p goes, unless its nucleus reaches that far.
    remove = active.expand(probs.shape).clone().scatter_(-1, order, removed)  # [rows, positions, vocab]
    reaches_past = ~removed[..., -1] & active[..., 0]  # [rows, positions]
    if bool(reaches_past.any()):  # a CPU's read, which costs nothing: only those positions are sorted
        rows, positions = reaches_past.nonzero(as_tuple=True)
        remove[rows, positions] = outside_nucleus_by_sort(probs[rows, positions], threshold[rows, 0])
    return logits.masked_fill(remove, float("-inf"))


def outside_nucleus_by_sort(
    probs: torch.Tensor,  # [..., vocab]
    threshold: torch.Tensor,  # broadcast to [..., 1]: top_p
) -> torch.Tensor:  # [..., vocab] bool
    """Which tokens fall outside the nucleus, from one sort of the whole vocabulary."""
    values, order = probs.sort(dim=-1, descending=True)
    removed = _outside_nucleus(values, threshold)
    return torch.zeros_like(removed).scatter_(-1, order, removed)


def _outside_nucleus(
    values: torch.Tensor,  # [..., n]: probabilities in descending order
    threshold: torch.Tensor,  # broadcast to [..., 1]: top_p
) -> torch.Tensor:  # [..., n] bool
    """Which of the sorted probabilities fall outside the nucleus: those whose mass before them reaches
    top_p; the first never does."""
    removed = (values.cumsum(dim=-1) - values) >= threshold
    removed[..., 0] = False
    return removed


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: on a GPU through pinned memory, without the host waiting for the copy
    (a copy from pageable memory waits for it). The pinned copy stays alive until the copy is done:
    the caching host allocator keeps a pinned block until the stream's work that reads it has run."""
    if device.type != "cuda" or host.device.type != "cpu" or not torch.cuda.is_available():
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """A device tensor on its way to the host, read later (`tolist`). On a GPU it is copied into pinned
    memory behind the work queued so far, and an event marks the copy's end: the read then waits for
    that work only, not for what the host queued after it (the next step's pass, `SpeculativeEngine`'s
    overlapped plain steps). Elsewhere it is the tensor itself."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.event = None
        if tensor.device.type == "cuda":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
            tensor = host
        self.tensor = tensor

    def tolist(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.tensor.tolist()


def sample_from_probs(
    probs: torch.Tensor,  # [rows, vocab]
    uniforms: torch.Tensor,  # [rows] in [0, 1)
) -> torch.Tensor:
    """Inverse-CDF sampling: one token per row from one uniform per row.

    A row's vocabulary is read in blocks of SAMPLE_BLOCK tokens: the blocks' masses (float32 sums of
    SAMPLE_BLOCK values) are summed up in float64 to find the block the uniform falls in, and only
    that block's cumulative sum is taken token by token, in float64 from the mass before it. A
    cumulative sum of the whole vocabulary in float64 (a float32 one over 150k entries drifts by
    ~1e-4) cost a copy and a sum of every row's every token: 214 ms for 16 rows x 9 positions of
    151,936 tokens on 2 cores, against 5 ms in blocks (`scripts.bench.vocab_ops`). Every token keeps
    its own probability as the width of its interval, except the last token with mass of a block,
    whose interval ends where the block's float32 sum says: off by that sum's rounding, about 1e-7
    of the block's mass, the precision of the float32 probabilities themselves.

    Returns:
        token_ids: [rows] long. A token with probability 0 is never returned.
    """
    assert probs.dim() == 2 and uniforms.shape == probs.shape[:1], (probs.shape, uniforms.shape)
    rows, vocab = probs.shape
    if vocab <= SAMPLE_BLOCK:
        cdf = probs.double().cumsum(dim=-1)  # [rows, vocab]
        threshold = uniforms.to(cdf)[:, None] * cdf[:, -1:]  # [rows, 1]
        return _first_past(cdf, threshold).squeeze(-1)
    num_full = vocab // SAMPLE_BLOCK
    masses = probs[:, : num_full * SAMPLE_BLOCK].reshape(rows, num_full, SAMPLE_BLOCK).sum(dim=-1)  # [rows, full]
    if num_full * SAMPLE_BLOCK < vocab:
        masses = torch.cat([masses, probs[:, num_full * SAMPLE_BLOCK :].sum(dim=-1, keepdim=True)], dim=-1)
    block_cdf = masses.double().cumsum(dim=-1)  # [rows, blocks]
    threshold = uniforms.to(block_cdf)[:, None] * block_cdf[:, -1:]  # [rows, 1]
    block = _first_past(block_cdf, threshold)  # [rows, 1]: a block with mass
    before = torch.where(block > 0, block_cdf.gather(-1, (block - 1).clamp(min=0)), 0.0)  # [rows, 1]
    token_ids = block * SAMPLE_BLOCK + torch.arange(SAMPLE_BLOCK, device=probs.device)  # [rows, block]
    inside = token_ids < vocab  # the last block may be short
    values = probs.gather(-1, token_ids.clamp(max=vocab - 1)).masked_fill(~inside, 0.0)
    cdf = values.double().cumsum(dim=-1) + before  # [rows, block]
    return (block * SAMPLE_BLOCK + _first_past(cdf, threshold)).squeeze(-1)


def _first_past(
    cdf: torch.Tensor,  # [rows, n] non-decreasing
    threshold: torch.Tensor,  # [rows, 1]
) -> torch.Tensor:  # [rows, 1] long
    """The first index whose cdf passes the threshold: its own mass took the cdf there, so it has
    some. A threshold at or past the last value (u * total rounding up to the total, or a block's
    sums rounding apart from its tokens') takes the index where the cdf reaches its last value: the
    last with mass (looked up, not found by a scan: that cost more than the cumulative sum)."""
    first = torch.searchsorted(cdf, threshold, right=True)
    return torch.minimum(first, torch.searchsorted(cdf, cdf[:, -1:].contiguous()))


def rejection_sample(
    target_probs: torch.Tensor,  # [batch, k + 1, vocab]
    draft_probs: torch.Tensor,  # [batch, k, vocab]
    draft_token_ids: torch.Tensor,  # [batch, k]
    num_draft_tokens: torch.Tensor,  # [batch] long, each <= k
    uniforms: torch.Tensor,  # [batch, k + 1] float64 in [0, 1)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verifies draft tokens against the target and returns what to emit.

    Row b only looks at its first `num_draft_tokens[b]` drafts, so one batch can
    mix requests with different k (0 is plain target sampling). Column j < k of
    `uniforms` decides the acceptance of draft j; the last column samples the
    recovered or bonus token.

    Returns:
        num_accepted: [batch] long, accepted drafts per row.
        output_token_ids: [batch, k + 1] long: the accepted drafts, then the
            recovered or bonus token at index num_accepted, then -1.
    """
    batch_size, k_plus_1, vocab_size = target_probs.shape
    k = k_plus_1 - 1
    assert draft_probs.shape == (batch_size, k, vocab_size), (draft_probs.shape, target_probs.shape)
    assert draft_token_ids.shape == (batch_size, k), draft_token_ids.shape
    assert num_draft_tokens.shape == (batch_size,), num_draft_tokens.shape
    assert uniforms.shape == (batch_size, k + 1), uniforms.shape
    device = target_probs.device
    positions = torch.arange(k, device=device)  # [k]

    target_at_draft = target_probs[:, :k].gather(-1, draft_token_ids[..., None]).squeeze(-1)  # [batch, k]
    draft_at_draft = draft_probs.gather(-1, draft_token_ids[..., None]).squeeze(-1)  # [batch, k]
    # u < p/q written as u * q < p, in float64 because float32 can round u * q up to p.
    # A draft token with q = 0 is rejected, to avoid 0/0; the draft cannot have sampled it.
    accepted = (uniforms[:, :k] * draft_at_draft.double() < target_at_draft.double()) & (draft_at_draft > 0)
    accepted &= positions[None, :] < num_draft_tokens[:, None]
    num_accepted = accepted.int().cumprod(dim=-1).sum(dim=-1)  # [batch]

    rows = torch.arange(batch_size, device=device)
    target_next = target_probs[rows, num_accepted]  # [batch, vocab]
    rejected = num_accepted < num_draft_tokens  # [batch]
    # Bonus rows have no draft distribution at num_accepted; any row is fine there.
    draft_next = draft_probs[rows, num_accepted.clamp(max=max(k - 1, 0))] if k > 0 else torch.zeros_like(target_next)
    residual = (target_next - draft_next).clamp(min=0)
    residual_mass = residual.sum(dim=-1, keepdim=True)  # [batch, 1]
    # p <= q everywhere means p == q, where rejection has probability 0; rounding can
    # still get here, and then p itself is the right distribution.
    use_residual = rejected[:, None] & (residual_mass > 0)
    next_probs = torch.where(
        use_residual, residual / residual_mass.clamp(min=torch.finfo(residual.dtype).tiny), target_next
    )
    next_token_ids = sample_from_probs(next_probs, uniforms[:, k])  # [batch]

    output_token_ids = torch.full((batch_size, k + 1), -1, dtype=torch.long, device=device)
    output_token_ids[:, :k] = torch.where(positions[None, :] < num_accepted[:, None], draft_token_ids, -1)
    output_token_ids[rows, num_accepted] = next_token_ids
    return num_accepted, output_token_ids


@functools.lru_cache(maxsize=64)
def greedy_uniforms(rows: int, width: int) -> torch.Tensor:  # [rows, width] float64, on the CPU
    """Zeros for the uniforms of rows that draw none (greedy): one tensor per shape, shared by every
    step of that shape, where a step of greedy rows would make its own (a few tensors a step, each a
    host call that costs as much as a small pass's bookkeeping). Only read, never written: whatever
    fills uniforms in (a sampled row's draws, a coupled row's positions) fills a tensor of its own."""
    return torch.zeros((rows, width), dtype=torch.float64)


def draw_step_uniforms(
    generators: Sequence[torch.Generator | None],
    num_draft_tokens: Sequence[int],
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draws one speculative step's uniforms, each request from its own generator.

    Request b takes exactly 2 * num_draft_tokens[b] + 1 draws, in a fixed order
    (draft sampling, acceptance, recovered/bonus), whatever else shares its
    batch. Rows without a generator (greedy, and coupled rows, whose uniforms
    come from `position_uniforms`) get zeros. Uniforms are float64 because
    float32 returns exactly 0.0 often enough to matter.

    Returns:
        draft_uniforms: [batch, k] for sampling the drafts.
        verify_uniforms: [batch, k + 1] for `rejection_sample`, the last column
            for the recovered or bonus token.
    """
    batch_size = len(generators)
    draft_uniforms = torch.zeros(batch_size, k, dtype=torch.float64)
    verify_uniforms = torch.zeros(batch_size, k + 1, dtype=torch.float64)
    for row, (generator, num_drafts) in enumerate(zip(generators, num_draft_tokens)):
        assert 0 <= num_drafts <= k, (num_drafts, k)
        if generator is None:
            continue
        draws = torch.rand(2 * num_drafts + 1, generator=generator, dtype=torch.float64)
        draft_uniforms[row, :num_drafts] = draws[:num_drafts]
        verify_uniforms[row, :num_drafts] = draws[num_drafts : 2 * num_drafts]
        verify_uniforms[row, k] = draws[2 * num_drafts]
    return draft_uniforms, verify_uniforms


_MASK_64 = (1 << 64) - 1


def _position_hash(seed: int, position: int) -> int:
    """A 64-bit hash of (request seed, output position): splitmix64's finaliser.

    Nearby seeds and positions give unrelated values, and a value depends on
    nothing else (k, the step it falls in, the batch).
    """
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK_64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return z ^ (z >> 31)


def position_uniforms(seed: int, first_position: int, num_positions: int) -> torch.Tensor:
    """The uniforms of output positions first_position .. first_position + num_positions - 1.

    Counter-based: each uniform is the top 53 bits of its position's hash, so
    no generator state is carried from step to step.

    Returns:
        uniforms: [num_positions] float64 in [0, 1); entry i depends only on
            (seed, first_position + i).
    """
    hashes = [_position_hash(seed, first_position + i) for i in range(num_positions)]
    return torch.tensor([(h >> 11) * 2.0**-53 for h in hashes], dtype=torch.float64)


def coupled_targets(
    target_probs: torch.Tensor,  # [batch, k + 1, vocab]
    uniforms: torch.Tensor,  # [batch, k + 1] float64: each position's own uniform
) -> torch.Tensor:  # [batch, k + 1] long, where the probabilities are
    """The target's own token at each position of coupled rows: its inverse-CDF sample with that
    position's uniform. Drafts are then accepted while they equal these (`match_drafts`): every
    emitted token is the target's own sample, whatever was drafted. The engine reads them with the rest
    of its step's outcome (`handler.engine.verify`)."""
    batch_size, k_plus_1, vocab_size = target_probs.shape
    assert uniforms.shape == (batch_size, k_plus_1), uniforms.shape
    return sample_from_probs(target_probs.reshape(-1, vocab_size), uniforms.reshape(-1)).reshape(batch_size, k_plus_1)


def greedy_verify(
    target_logits: torch.Tensor,  # [batch, k + 1, vocab], after each row's rules
    draft_token_ids: Sequence[Sequence[int]],  # per row, its k drafts (or more: padding, never read)
    num_draft_tokens: Sequence[int],  # per row, its drafts, each <= k
    read: Callable[[torch.Tensor], list] | None = None,
) -> tuple[list[int], list[list[int]]]:
    """`rejection_sample` for a batch whose every row is greedy, from the logits: the same results, read
    to the host (as `match_drafts` gives them).

    On one-hot distributions with zero uniforms, rejection sampling accepts a draft iff it is the
    target's argmax (its draft distribution is one-hot at the draft itself: a greedy draw, a look-up),
    and the recovered or bonus token is the target's argmax. So neither side's distribution over the
    vocabulary is built: one argmax per position, instead of the one-hot tensors, the residual and a
    cumulative sum over the vocabulary; and one read of those argmaxes, the comparisons on the host.

    `read`: argmaxes [batch, k + 1] -> their lists; the step's one read, which may bring more with it
    (drafts still on the device, filled into `draft_token_ids` before they are compared). None: `tolist`.
    """
    targets = argmax_vocab(target_logits)  # [batch, k + 1]
    targets = targets.tolist() if read is None else read(targets)
    return match_drafts(targets, draft_token_ids, num_draft_tokens)


def match_drafts(
    target_token_ids: Sequence[Sequence[int]],  # per row [k + 1]: the target's own token at each position
    draft_token_ids: Sequence[Sequence[int]],  # per row, its drafts (at least num_draft_tokens of them)
    num_draft_tokens: Sequence[int],  # per row, its drafts, each <= k
) -> tuple[list[int], list[list[int]]]:
    """Drafts accepted while they equal the target's own tokens, then the target's token at the first
    mismatch (or the bonus position): coupling and `greedy_verify` once the target's tokens are
    read. On the host: a few comparisons a row, where the same on tensors is a dozen small ops.

    Returns:
        num_accepted: per row, its accepted drafts.
        output_token_ids: per row [k + 1]: the target's tokens up to and including index
            num_accepted, then -1.
    """
    num_accepted, output_token_ids = [], []
    for targets, drafts, num in zip(target_token_ids, draft_token_ids, num_draft_tokens, strict=True):
        accepted = 0
        while accepted < num and drafts[accepted] == targets[accepted]:
            accepted += 1
        num_accepted.append(accepted)
        output_token_ids.append([*targets[: accepted + 1], *[-1] * (len(targets) - accepted - 1)])
    return num_accepted, output_token_ids
