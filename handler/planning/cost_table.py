"""A measured cost table: seconds per target forward by batch size and width, and per draft step.

What a speculative step costs depends on the machine far more than on the
model: on a GPU a verification over 8 tokens costs about as much as one, while
on some CPUs a forward over 4 tokens costs twice one. So the table is measured
at start-up, on the real device, dtype and models, in the way the engine
calls them: through the serving runner (`handler.runners`), a chunk of
`width` new tokens appended to a cached context of about 100 tokens per row,
with `logits_to_keep = width` (the engine keeps the logits of every verified
position).

The grid is sparse (widths 1, 2, 3, 4, then powers of two, and the largest;
batch sizes 1, powers of two, and the largest) and the table interpolates
linearly in between. When a measurement takes long, the table is cached as
JSON in a folder the caller names, keyed by the machine, the thread count,
torch's version, the models' identity and the grid; any change re-measures.

While it serves, the engine keeps the table honest with `RunningCostTable`:
the passes it times rescale the start-up figures. `CostModel` is a linear table
(a fixed cost per pass plus one per extra verified token), for tests and
back-of-the-envelope estimates. The measuring is in `handler.planning.measure`.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
import statistics
from typing import Any, Sequence

logger = logging.getLogger(__name__)

# The running correction (`RunningCostTable`): forward passes per model in its median, the passes
# seen before it departs from the table, and the most it scales the table either way.
RUNNING_WINDOW = 64
MIN_OBSERVATIONS = 8
MAX_SCALE = 4.0


def sparse_grid(maximum: int, dense_up_to: int = 1) -> tuple[int, ...]:
    """1..dense_up_to, then the powers of two below `maximum`, then `maximum`."""
    assert maximum >= 1, maximum
    points = set(range(1, min(dense_up_to, maximum) + 1))
    power = 2
    while power < maximum:
        points.add(power)
        power *= 2
    points.add(maximum)
    return tuple(sorted(points))


def _interpolate(points: Sequence[int], values: Sequence[float], x: float) -> float:
    """Piecewise-linear through (points, values); linear extrapolation past the last point."""
    assert len(points) == len(values) and len(points) >= 1
    if len(points) == 1:
        # One point: cost proportional to x, the honest guess for a bigger batch or chunk.
        return values[0] * x / points[0]
    if x <= points[0]:
        return values[0]
    index = min(bisect.bisect_left(points, x), len(points) - 1)
    left, right = points[index - 1], points[index]
    fraction = (x - left) / (right - left)
    return max(0.0, values[index - 1] + fraction * (values[index] - values[index - 1]))


@dataclasses.dataclass(frozen=True)
class CostTable:
    """Seconds per forward pass on one machine.

    Attributes:
        widths: measured chunk widths, ascending, starting at 1.
        batch_sizes: measured batch sizes, ascending, starting at 1.
        target: target seconds, [len(batch_sizes)][len(widths)].
        draft: draft seconds for a one-token step, [len(batch_sizes)]; None when
            no draft model was measured (an n-gram-only deployment).
    """

    widths: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    target: tuple[tuple[float, ...], ...]
    draft: tuple[float, ...] | None = None
    # (batch size, width) -> target seconds: the planner asks for the same few shapes every step.
    _memo: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        assert self.widths and self.widths[0] == 1 and list(self.widths) == sorted(set(self.widths)), self.widths
        assert (
            self.batch_sizes and self.batch_sizes[0] == 1 and list(self.batch_sizes) == sorted(set(self.batch_sizes))
        ), self.batch_sizes
        assert len(self.target) == len(self.batch_sizes), (len(self.target), self.batch_sizes)
        assert all(len(row) == len(self.widths) for row in self.target), self.target
        assert self.draft is None or len(self.draft) == len(self.batch_sizes), self.draft

    @property
    def has_draft(self) -> bool:
        return self.draft is not None

    def target_seconds(self, batch_size: int, width: int) -> float:
        """The target's forward over `width` new tokens for each of `batch_size` rows.

        Bilinear between grid points; past the grid, extrapolated from its edge.
        """
        seconds = self._memo.get((batch_size, width))
        if seconds is None:
            assert batch_size >= 1 and width >= 1, (batch_size, width)
            by_batch = [_interpolate(self.widths, row, width) for row in self.target]
            seconds = self._memo[batch_size, width] = _interpolate(self.batch_sizes, by_batch, batch_size)
        return seconds

    def draft_seconds(self, batch_size: int) -> float:
        """The draft's step over one new token for each of `batch_size` rows."""
        assert self.draft is not None, "this table has no draft: it was measured without a draft model"
        assert batch_size >= 1, batch_size
        return _interpolate(self.batch_sizes, self.draft, batch_size)

    def format(self) -> str:
        """A multi-line table in milliseconds, for the log and the benchmark."""
        header = "batch \\ width " + "".join(f"{width:>9d}" for width in self.widths)
        lines = ["target forward (ms) over a chunk of `width` new tokens per row:", header]
        for batch_size, row in zip(self.batch_sizes, self.target):
            lines.append(f"{batch_size:>13d} " + "".join(f"{seconds * 1e3:>9.1f}" for seconds in row))
        lines.append(
            "cost of width w / width 1, batch 1: "
            + ", ".join(
                f"{width}: {seconds / self.target[0][0]:.2f}" for width, seconds in zip(self.widths, self.target[0])
            )
        )
        if self.draft is None:
            lines.append("draft step: none (no draft model)")
        else:
            lines.append(
                "draft step (ms) by batch size: "
                + ", ".join(f"{batch}: {seconds * 1e3:.1f}" for batch, seconds in zip(self.batch_sizes, self.draft))
            )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "widths": list(self.widths),
            "batch_sizes": list(self.batch_sizes),
            "target_seconds": [list(row) for row in self.target],
            "draft_seconds": None if self.draft is None else list(self.draft),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CostTable:
        draft = data["draft_seconds"]
        return cls(
            widths=tuple(int(w) for w in data["widths"]),
            batch_sizes=tuple(int(b) for b in data["batch_sizes"]),
            target=tuple(tuple(float(s) for s in row) for row in data["target_seconds"]),
            draft=None if draft is None else tuple(float(s) for s in draft),
        )


class RunningCostTable:
    """A measured table, rescaled by the forward passes the engine times while it serves.

    The table is measured once, at start-up, over a few seconds. On a shared
    machine those seconds may be slow or fast ones, and the engine's real
    contexts are longer than the table's 100 tokens. Either way the planner
    would trust a ratio of draft to target cost the machine no longer has. So
    each target pass and each draft step the engine runs is divided by the
    table's figure for its batch size and width, and the median of the last
    `RUNNING_WINDOW` such ratios, per model, scales what the table says. A
    median ignores a burst of load; a lasting change moves it within a window.

    The table's shape is corrected too, width by width. Its fit makes a wider
    pass never cheaper, against noise at start-up; but some kernels are
    cheaper at some widths (on one AVX512 CPU, bf16 with packed weights: 168 ms
    over 2 tokens, 130 ms over 5). So each (batch size, width) the engine runs
    keeps its own median of observed / expected, the expected being the
    table's figure times the model's scale of the moment: a machine that slows
    down as a whole moves the scale, and the shape stays. Batch sizes share
    their nearest grid point's shape (7 rows learn with 8), so that a batch
    whose size keeps changing under load still corrects its table quickly. The
    draft step keeps a shape per batch size alike: its real step (guessed
    drafts widen it, the warping grows with the rows) departs from the table's
    one-token forward more at some sizes than at others.

    A draft step is timed whole: its forward, and the warping and sampling that
    every draft pays too. A target pass is timed over its forward only, the
    part the table measures. On a GPU the forward runs asynchronously, and
    timing it would cost a synchronisation per step: there the engine does not
    observe, and the table stands as measured.
    """

    def __init__(self, table: CostTable, window: int | None = None) -> None:
        self.table = table
        self.window = RUNNING_WINDOW if window is None else window
        # Per model, the latest ratios of observed to measured seconds, oldest first.
        self.ratios: dict[str, list[float]] = {"target": [], "draft": []}
        self._medians: dict[str, float | None] = {"target": None, "draft": None}
        # Per (batch size, width): the latest target passes' seconds over the scaled table's, and
        # their median once there are enough.
        self.shapes: dict[tuple[int, int], list[float]] = {}
        self._shape_medians: dict[tuple[int, int], float] = {}
        # Per batch size: the latest draft steps' seconds over the scaled table's, and their median.
        self.draft_shapes: dict[int, list[float]] = {}
        self._draft_shape_medians: dict[int, float] = {}
        # Tree passes (a custom attention mask, then the accepted path moved to the chunk's front):
        # their seconds over a chain pass's of the same shape, as the corrected table prices it.
        self.tree_ratios: list[float] = []
        self._tree_median: float | None = None
        self._buckets: dict[int, int] = {}
        # The draft's latest prefills of joining rows (`observe_fill`): seconds per token, and their median.
        self.fill_token_seconds: list[float] = []
        self._fill_median: float | None = None

    @property
    def tree_factor(self) -> float:
        """A tree pass's seconds over a chain pass's of the same batch size and width; 1 until timed."""
        return 1.0 if self._tree_median is None else self._tree_median

    @property
    def target_scale(self) -> float:
        """Observed / measured seconds of a target pass; 1 until enough passes were timed."""
        median = self._medians["target"]
        return 1.0 if median is None else median

    @property
    def draft_scale(self) -> float:
        """Observed / measured seconds of a draft step. Until enough steps were timed, the target's
        scale: a machine that got slower slows both, and a planner that stopped drafting would
        otherwise keep the draft's stale figure against the target's fresh one."""
        median = self._medians["draft"]
        return self.target_scale if median is None else median

    @property
    def draft_token_seconds(self) -> float | None:
        """The draft's seconds per token over a wide chunk, as its prefills of joining rows ran; None
        until one was timed. The table times one-token passes only: a wider pass of the draft is
        priced from the target's cost of that width, which past the table's widths it extrapolates,
        flat where a few tokens cost what one does, while hundreds cost each their share of compute."""
        return self._fill_median

    def _bucket(self, batch_size: int) -> int:
        """The table's batch size nearest to `batch_size` (by ratio): whose shape it shares."""
        bucket = self._buckets.get(batch_size)
        if bucket is None:
            bucket = min(self.table.batch_sizes, key=lambda grid: abs(math.log(grid / batch_size)))
            self._buckets[batch_size] = bucket
        return bucket

    def target_seconds(self, batch_size: int, width: int) -> float:
        shape = self._shape_medians.get((self._bucket(batch_size), width), 1.0)
        return self.table.target_seconds(batch_size, width) * self.target_scale * shape

    def draft_seconds(self, batch_size: int) -> float:
        shape = self._draft_shape_medians.get(self._bucket(batch_size), 1.0)
        return self.table.draft_seconds(batch_size) * self.draft_scale * shape

    def observe_target(self, batch_size: int, width: int, seconds: float, tree: bool = False) -> None:
        """One target forward of `width` new tokens per row over `batch_size` rows took `seconds`
        (`tree`: some row verified a tree, its seconds go to `tree_factor` only)."""
        measured = self.table.target_seconds(batch_size, width)
        if measured <= 0.0:
            return  # a table that calls a pass free has no ratio to offer (and must not fail a step)
        if tree:
            median = _windowed(self.tree_ratios, seconds / self.target_seconds(batch_size, width), self.window)
            if median is not None:
                self._tree_median = median
            return
        ratio = seconds / measured
        self._observe("target", ratio)
        if self._medians["target"] is None:
            return  # no scale yet: a shape taken now would hold the scale too
        key = (self._bucket(batch_size), width)
        shape = _windowed(self.shapes.setdefault(key, []), ratio / self.target_scale, self.window)
        if shape is not None:
            self._shape_medians[key] = shape

    def observe_draft(self, batch_size: int, num_steps: int, seconds: float) -> None:
        """`num_steps` draft steps over `batch_size` rows took `seconds` in all."""
        measured = num_steps * self.table.draft_seconds(batch_size)
        if measured <= 0.0:
            return
        ratio = seconds / measured
        self._observe("draft", ratio)
        if self._medians["draft"] is None:
            return
        key = self._bucket(batch_size)
        shape = _windowed(self.draft_shapes.setdefault(key, []), ratio / self.draft_scale, self.window)
        if shape is not None:
            self._draft_shape_medians[key] = shape

    def observe_fill(self, num_tokens: int, seconds: float) -> None:
        """The draft's prefill of `num_tokens` tokens (joining rows, in one pass) took `seconds`."""
        if num_tokens <= 0:
            return
        self.fill_token_seconds.append(seconds / num_tokens)
        del self.fill_token_seconds[: -self.window]
        # One prefill is hundreds of tokens timed together: the first already beats an extrapolation.
        self._fill_median = statistics.median(self.fill_token_seconds)

    def _observe(self, model: str, ratio: float) -> None:
        """Adds a ratio of observed to measured seconds to the model's window."""
        median = _windowed(self.ratios[model], ratio, self.window)
        if median is not None:
            self._medians[model] = median


def _windowed(ratios: list[float], ratio: float, window: int) -> float | None:
    """Appends `ratio` (clamped to MAX_SCALE either way), keeps the last `window`; returns their
    median, or None while they are fewer than MIN_OBSERVATIONS."""
    ratios.append(min(max(ratio, 1.0 / MAX_SCALE), MAX_SCALE))
    del ratios[:-window]
    return statistics.median(ratios) if len(ratios) >= MIN_OBSERVATIONS else None


@dataclasses.dataclass(frozen=True)
class CostModel:
    """A linear cost table: the draft on one token, the target on 1 + k tokens, any batch size."""

    draft_step: float
    target_step: float
    target_per_extra_token: float

    def target_seconds(self, batch_size: int, width: int) -> float:
        """The cost-table view of this linear model (it ignores the batch size)."""
        return self.target_step + (width - 1) * self.target_per_extra_token

    def draft_seconds(self, batch_size: int) -> float:
        return self.draft_step
