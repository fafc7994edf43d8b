"""The static runner: KV preallocated per row slot, fixed shapes, CUDA graphs on CUDA.

Layout. Each layer keeps keys and values of shape [slots, kv_heads, columns + 1,
head_dim], allocated once and grown (doubled, copied) only when a batch needs more
rows or a row more columns than the buffers hold. Row `b` of the engine's batch
lives in slot `slots[b]`, its valid tokens in columns 0..lengths[b]-1 with no
holes: a rollback is a new length, nothing is cropped or copied, and whatever lies
beyond a row's length is never attended to and is overwritten by its next chunk. A
leaving row frees its slot; a joining row takes the lowest free slot and its
prefilled KV is copied in (the only copy of a prompt's KV). The last column is a
scratch column that warm-up passes write to, so that they never touch a live row.

Shapes. A pass is padded to a bucketed shape (batch, width, kept logits, attended
columns):

- batch: the slots in use, rounded up to a power of two; free slots in that range
  run a dummy row that writes only to its own free slot;
- width: the chunk's width rounded up to `WIDTH_BUCKETS`, with padding columns on
  the left, as in a ragged chunk;
- kept logits: 1 or the whole width;
- attended columns: the longest row plus the width, rounded up to a multiple of
  `COLUMN_STEP` up to `LONG_COLUMNS`, of `LONG_COLUMN_STEP` beyond.

Within a pass, chunk column j of row b is written to column lengths[b] + offset[b, j],
real tokens first and in order, padding after them, and it attends to the row's
valid columns and to the chunk columns `allowed[b, j]` names (its predecessors for
a chain, its ancestors for a tree). The additive mask is built inside the pass from
these small tensors, so a step copies a few hundred bytes to the device, never a
mask of the attended length.

On CUDA each shape is captured once as a CUDA graph, lazily, and replayed: a pass
is one graph launch with no host synchronisation inside. On the CPU the same
padded pass runs eagerly (docs/architecture.md says what each costs).

The prefix cache still copies a cached prefix into a slot: slots are contiguous,
and sharing KV by reference would need a paged layout with a block table.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from handler.caches.kv_cache import RaggedCache, attention_masks, kv_layout, sliding_layout
from handler.sampler import host_to_device

# Widths a chunk is padded to; beyond the last, the next multiple of it.
WIDTH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 18, 20, 24, 28, 32)
# Attended columns are rounded up to a multiple of this.
COLUMN_STEP = 128
# Beyond this many columns the step is coarser: fewer shapes to capture for long contexts, where
# attention over a few hundred extra masked columns costs little next to the weights.
LONG_COLUMNS = 2048
LONG_COLUMN_STEP = 1024
# The most graphs a runner keeps; the least recently replayed goes first. Each holds its output
# logits ([batch, kept, vocab]: up to ~150 MB for 16 rows of 32 over a 152k vocabulary in bf16).
MAX_GRAPHS = 48
# Shapes beyond these run eagerly even on CUDA (a long prompt's pending tokens, a huge batch).
MAX_GRAPH_WIDTH = 32
MAX_GRAPH_BATCH = 64


def width_bucket(width: int) -> int:
    for bucket in WIDTH_BUCKETS:
        if width <= bucket:
            return bucket
    step = WIDTH_BUCKETS[-1]
    return -(-width // step) * step


def batch_bucket(num_slots: int) -> int:
    return 1 << max(0, num_slots - 1).bit_length()


def column_bucket(columns: int) -> int:
    step = COLUMN_STEP if columns <= LONG_COLUMNS else LONG_COLUMN_STEP
    return -(-columns // step) * step


@functools.cache
def _chain_layout(width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's columns [width] and a chain's visibility [width, width] (each column sees those before it)."""
    return torch.arange(width), torch.ones((width, width), dtype=torch.bool).tril()


class _SlotLayer(CacheLayerMixin):
    """One layer's preallocated KV; each pass scatters its chunk in and attends to a prefix of columns."""

    is_compileable = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values = keys, values  # [slots, kv_heads, columns + 1, head_dim]
        self.is_initialized = True
        # Set before each pass (`StaticRunner._pass`): the rows and columns it covers, and where
        # each chunk column is written ([rows, width] long, on the device).
        self.num_rows = 0
        self.num_columns = 0
        self.write_index: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # allocated up front

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states, value_states: [rows, kv_heads, width, head_dim]
        index = self.write_index[:, None, :, None].expand_as(key_states)
        keys, values = self.keys[: self.num_rows], self.values[: self.num_rows]
        keys.scatter_(2, index, key_states)
        values.scatter_(2, index, value_states)
        return keys[:, :, : self.num_columns], values[:, :, : self.num_columns]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.num_columns, 0

    def get_seq_length(self) -> int:
        return 0  # positions are always given

    def get_max_length(self) -> int:
        return self.keys.shape[2] - 1


@dataclasses.dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]  # the static input tensors the graph reads
    logits: torch.Tensor  # the static output it writes: [batch, kept, vocab]


class StaticRunner:
    """Preallocated KV and fixed shapes for one model; CUDA graphs on CUDA (module docstring)."""

    kind = "static"

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_slots: int = 1,
        num_columns: int = 4 * COLUMN_STEP,
        graphs: bool | None = None,
    ) -> None:
        """
        Args:
            num_slots, num_columns: the buffers' first size; both grow on demand.
            graphs: capture CUDA graphs; None: on CUDA only.
        """
        self.model = model
        self.device = next(model.parameters()).device
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        assert not self.graphs or self.device.type == "cuda", "CUDA graphs need a CUDA device"
        self.num_layers, self.num_kv_heads, self.head_dim = kv_layout(model)
        self.dtype = model.dtype
        # Sliding-window layers keep every token too; their window is in the mask (`handler.caches.kv_cache`).
        self.layout = sliding_layout(model)
        self.layers = [
            _SlotLayer(*(self._zeros(num_slots, column_bucket(num_columns)) for _ in range(2)))
            for _ in range(self.num_layers)
        ]
        self.cache = Cache(layers=self.layers)
        # (batch, width, kept logits, columns) -> its graph, least recently replayed first.
        self._graphs: dict[tuple[int, int, int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self.num_captures = 0  # graphs captured since start (they are dropped when the buffers grow)

    def _zeros(self, num_slots: int, num_columns: int) -> torch.Tensor:
        shape = (num_slots, self.num_kv_heads, num_columns + 1, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    @property
    def num_slots(self) -> int:
        return self.layers[0].keys.shape[0]

    @property
    def num_columns(self) -> int:
        return self.layers[0].keys.shape[2] - 1

    def adopt(self, prefilled: RaggedCache) -> SlotCache:
        batch = SlotCache(self)
        batch.extend(prefilled)
        return batch

    @torch.inference_mode()
    def reserve(self, num_slots: int, num_columns: int) -> None:
        """Grows the buffers (doubling) to hold `num_slots` slots of `num_columns` columns."""
        if num_slots <= self.num_slots and num_columns <= self.num_columns:
            return
        new_slots, new_columns = self.num_slots, self.num_columns
        while new_slots < num_slots:
            new_slots *= 2
        while new_columns < num_columns:
            new_columns *= 2
        for layer in self.layers:
            for name in ("keys", "values"):
                old = getattr(layer, name)
                new = self._zeros(new_slots, new_columns)
                new[: old.shape[0], :, : old.shape[2] - 1] = old[:, :, :-1]
                setattr(layer, name, new)
        self._graphs.clear()  # they read the old buffers
        if self.graphs:
            # A pool whose graphs are all gone while tensors it allocated live on (a step's logits)
            # cannot take a new capture (PyTorch asserts its use count): capture into a new one.
            self._pool = torch.cuda.graph_pool_handle()

    # ------------------------------------------------------------------ passes

    def run(
        self,
        input_ids: torch.Tensor,  # [batch, width] long, CPU
        positions: torch.Tensor,  # [batch, width] long, CPU
        lengths: torch.Tensor,  # [batch] long, CPU: each slot's valid tokens before the pass
        offsets: torch.Tensor,  # [batch, width] long, CPU: where each column goes, after the row's tokens
        allowed: torch.Tensor,  # [batch, width, width] bool, CPU: column j sees chunk offset t
        num_kept: int,
    ) -> torch.Tensor:
        """One padded pass over slots 0..batch-1; returns the static or fresh logits [batch, num_kept, vocab]."""
        batch_size, width = input_ids.shape
        num_columns = column_bucket(int(lengths.max()) + width)
        assert num_columns <= self.num_columns, (num_columns, self.num_columns)
        inputs = {
            "input_ids": input_ids,
            "positions": positions,
            "lengths": lengths,
            "offsets": offsets,
            "allowed": allowed,
        }
        if not (self.graphs and width <= MAX_GRAPH_WIDTH and batch_size <= MAX_GRAPH_BATCH):
            device_inputs = {name: host_to_device(tensor, self.device) for name, tensor in inputs.items()}
            return self._pass(**device_inputs, num_kept=num_kept, num_columns=num_columns)
        key = (batch_size, width, num_kept, num_columns)
        graph = self._graphs.pop(key, None)
        if graph is None:
            if len(self._graphs) >= MAX_GRAPHS:
                del self._graphs[next(iter(self._graphs))]  # the least recently replayed
            graph = self._capture(batch_size, width, num_kept, num_columns)
        self._graphs[key] = graph  # last: the most recently replayed
        for name, tensor in inputs.items():
            # A host tensor through pinned memory: a copy from pageable memory may wait for the passes
            # queued before it, which an overlapped step runs behind (`SpeculativeEngine.step`).
            if tensor.device.type == "cpu" and self.device.type == "cuda":
                tensor = tensor.pin_memory()
            graph.inputs[name].copy_(tensor, non_blocking=True)
        graph.graph.replay()
        return graph.logits

    def _pass(self, input_ids, positions, lengths, offsets, allowed, num_kept: int, num_columns: int) -> torch.Tensor:
        batch_size, width = input_ids.shape
        write_index = lengths[:, None] + offsets  # [batch, width]
        relative = torch.arange(num_columns, device=self.device)[None, :] - lengths[:, None]  # [batch, columns]
        in_chunk = allowed.gather(2, relative.clamp(0, width - 1)[:, None, :].expand(batch_size, width, num_columns))
        seen = (in_chunk & (relative < width)[:, None, :]) | (relative < 0)[:, None, :]  # [batch, width, columns]
        kv_positions = None
        if self.layout[0] is not None:
            # A slot's column c holds position c, but for a tree's columns: their positions go where they are written.
            columns = torch.arange(num_columns, device=self.device).expand(batch_size, num_columns)
            kv_positions = columns.scatter(1, write_index, positions)  # [batch, columns]
        mask = attention_masks(seen, kv_positions, positions, self.layout, self.dtype, self.device)
        for layer in self.layers:
            layer.num_rows, layer.num_columns, layer.write_index = batch_size, num_columns, write_index
        output = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=num_kept,
        )
        return output.logits

    def _capture(self, batch_size: int, width: int, num_kept: int, num_columns: int) -> _Graph:
        device = self.device
        inputs = {
            "input_ids": torch.zeros((batch_size, width), dtype=torch.long, device=device),
            "positions": torch.zeros((batch_size, width), dtype=torch.long, device=device),
            # Warm-up passes write every column to the scratch column beyond the last.
            "lengths": torch.full((batch_size,), self.num_columns, dtype=torch.long, device=device),
            "offsets": torch.zeros((batch_size, width), dtype=torch.long, device=device),
            "allowed": torch.ones((batch_size, width, width), dtype=torch.bool, device=device),
        }
        # Warm-up on a side stream, as CUDA graph capture wants (cuBLAS workspaces, lazy inits).
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._pass(**inputs, num_kept=num_kept, num_columns=num_columns)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._pass(**inputs, num_kept=num_kept, num_columns=num_columns)
        self.num_captures += 1
        return _Graph(graph, inputs, logits)


class SlotCache:
    """The running batch in a static runner's slots: the `handler.runners.BatchCache` interface."""

    def __init__(self, runner: StaticRunner) -> None:
        self.runner = runner
        self.slots: list[int] = []  # engine row -> slot
        self.lengths = torch.zeros(0, dtype=torch.long)  # [rows] valid tokens, CPU

    def forward(
        self,
        input_ids: torch.Tensor,  # [rows, width], on any device
        chunk_mask: torch.Tensor | None,  # [rows, width] long, CPU; 0 marks left padding; None: none
        logits_to_keep: int,
        tree: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """As `RaggedCache.forward`: appends a chunk to every row and returns its last logits."""
        num_rows, width = input_ids.shape
        unpadded = chunk_mask is None
        assert unpadded or chunk_mask.shape == input_ids.shape, (chunk_mask.shape, input_ids.shape)
        assert num_rows == len(self.slots), (num_rows, self.slots)
        padded = width_bucket(width)
        num_slots = batch_bucket(max(self.slots) + 1)
        runner = self.runner
        runner.reserve(num_slots, column_bucket(int(self.lengths.max()) + padded))
        columns, causal = _chain_layout(padded)  # [padded], [padded, padded]
        num_kept = 1 if logits_to_keep == 1 else padded
        dense = num_rows == num_slots and self.slots == list(range(num_rows))
        if dense and tree is None and width == padded and (unpadded or bool(chunk_mask.all())):
            # Every slot holds a row and no column is padding: the chunk goes in as it is.
            positions = self.lengths[:, None] + columns  # [rows, padded]
            offsets, allowed = columns.expand(num_rows, padded), causal.expand(num_rows, padded, padded)
            logits = runner.run(input_ids, positions, self.lengths, offsets, allowed, num_kept)
            self.lengths = self.lengths + width
            # A copy where the logits are a graph's output, which the next replay overwrites.
            logits = logits[:, num_kept - logits_to_keep :]
            return logits.clone() if runner.graphs else logits
        ids = torch.zeros((num_rows, padded), dtype=torch.long, device=input_ids.device)
        ids[:, padded - width :] = input_ids
        if tree is None:
            # Built only here: the dense path above takes an unpadded chunk without one.
            real = torch.full((num_rows,), width, dtype=torch.long) if unpadded else chunk_mask.sum(dim=1)  # [rows]
        else:
            allowed_chunk, depth = tree  # [rows, width, width] bool, [rows, width] long
            real = torch.full((num_rows,), width, dtype=torch.long)
        first = (padded - real)[:, None]  # [rows, 1]: each row's first real column
        is_real = columns[None, :] >= first  # [rows, padded]
        # Real columns first and in order, padding after them.
        offsets = torch.where(is_real, columns[None, :] - first, real[:, None] + columns[None, :])
        if tree is None:
            positions = self.lengths[:, None] + (columns[None, :] - first).clamp(min=0)
            allowed = columns[None, None, :] <= offsets[:, :, None]  # [rows, padded, padded]
        else:
            shift = padded - width
            positions = torch.zeros((num_rows, padded), dtype=torch.long)
            positions[:, shift:] = self.lengths[:, None] + depth.cpu()
            # A padding column sees itself only (its offset follows the tree's); a tree column its ancestors.
            allowed = torch.zeros((num_rows, padded, padded), dtype=torch.bool)
            allowed[:, torch.arange(shift), width + torch.arange(shift)] = True
            allowed[:, shift:, :width] = allowed_chunk.cpu()
        positions = torch.where(is_real, positions, 0)
        # Scattered to the slots; free slots run a dummy chain over their own columns.
        slot_index = torch.tensor(self.slots)
        all_ids = torch.zeros((num_slots, padded), dtype=torch.long, device=input_ids.device)
        all_positions = torch.zeros((num_slots, padded), dtype=torch.long)
        all_lengths = torch.zeros(num_slots, dtype=torch.long)
        all_offsets = columns.repeat(num_slots, 1)
        all_allowed = causal.repeat(num_slots, 1, 1)
        all_ids[slot_index.to(ids.device)] = ids
        all_positions[slot_index], all_lengths[slot_index] = positions, self.lengths
        all_offsets[slot_index], all_allowed[slot_index] = offsets, allowed
        logits = runner.run(all_ids, all_positions, all_lengths, all_offsets, all_allowed, num_kept)
        self.lengths = self.lengths + real
        return logits[slot_index.to(logits.device), num_kept - logits_to_keep :]  # a copy

    def rollback(self, lengths: torch.Tensor) -> None:  # [rows] long, CPU
        """Keeps each row's first `lengths[b]` tokens: a length, nothing moves."""
        assert bool((lengths <= self.lengths).all()), (lengths, self.lengths)
        self.lengths = lengths.clone()

    def keep_chunk_paths(self, chunk_width: int, paths: Sequence[Sequence[int]]) -> None:
        """As `RaggedCache.keep_chunk_paths`: each row's path moves to the front of its chunk."""
        moved, orders = [], []
        for row, path in enumerate(paths):
            assert list(path) == sorted(set(path)) and (not path or path[-1] < chunk_width), path
            kept = set(path)
            order = [*path, *(column for column in range(chunk_width) if column not in kept)]
            if order != list(range(chunk_width)):
                moved.append(row)
                orders.append(order)
        if not moved:
            return
        starts = self.lengths[moved] - chunk_width  # [moved]
        device = self.runner.device
        slots = torch.tensor([self.slots[row] for row in moved], device=device)[:, None]  # [moved, 1]
        source = (starts[:, None] + torch.tensor(orders)).to(device)  # [moved, chunk_width]
        target = (starts[:, None] + torch.arange(chunk_width)).to(device)
        with torch.inference_mode():
            for layer in self.runner.layers:
                for states in (layer.keys, layer.values):
                    states[slots, :, target] = states[slots, :, source]  # [moved, chunk_width, heads, head_dim]

    def select_rows(self, rows: Sequence[int]) -> None:
        """Keeps only `rows`, in that order; the others' slots are free."""
        self.slots = [self.slots[row] for row in rows]
        self.lengths = self.lengths[torch.tensor(rows, dtype=torch.long)]

    def extend(self, other: RaggedCache) -> None:
        """Appends `other`'s rows, each in the lowest free slot, their KV copied in.

        Every joining row at once: one copy per layer for the keys and one for the values. A copy
        per row and layer costs a launch and a few indexing calls each, and admitting a batch of
        rows then took the host longer than their prefill.
        """
        num_new = int(other.lengths.shape[0])
        used = set(self.slots)
        free = [slot for slot in range(len(used) + num_new) if slot not in used][:num_new]
        longest = int(other.lengths.max()) if num_new else 0
        self.runner.reserve(max(free, default=0) + 1, column_bucket(longest + 1))
        if longest:
            with torch.inference_mode():
                self._copy_in(other, free, longest)
        self.slots.extend(free)
        self.lengths = torch.cat([self.lengths, other.lengths])

    def _copy_in(self, other: RaggedCache, free: list[int], longest: int) -> None:
        """Copies `other`'s rows into the slots `free`, each row's tokens to its first columns."""
        runner = self.runner
        width = other.num_columns
        first = free[0]
        layers = zip(runner.layers, other.cache.layers)
        if free == list(range(first, first + len(free))) and bool(other.mask[:, width - longest :].all()):
            # Every row holds `longest` tokens in the last columns (prompts of one length, no prefix
            # cache hit), joining consecutive slots (an empty batch): a slice to a slice.
            for layer, theirs in layers:
                layer.keys[first : first + len(free), :, :longest] = theirs.keys[:, :, width - longest :]
                layer.values[first : first + len(free), :, :longest] = theirs.values[:, :, width - longest :]
            return
        # Each column of `other` goes to its token's position in the row; a hole, to the scratch column.
        targets = torch.where(other.mask.bool(), other.mask.cumsum(dim=1) - 1, runner.num_columns)  # [new, width]
        targets = host_to_device(targets, runner.device)
        slots = host_to_device(torch.tensor(free)[:, None], runner.device)  # [new, 1]
        for layer, theirs in layers:
            for mine, states in ((layer.keys, theirs.keys), (layer.values, theirs.values)):
                # [slots, columns + 1, heads, head_dim] <- [new, width, heads, head_dim]: one scatter.
                mine.transpose(1, 2)[slots, targets] = states.transpose(1, 2)

    def row_kv(self, slot: int, start: int, end: int) -> torch.Tensor:
        """A copy of row `slot`'s KV for its tokens start..end-1: [layers, 2, heads, end - start, head_dim]."""
        assert 0 <= start < end <= int(self.lengths[slot]), (start, end, self.lengths[slot])
        index = self.slots[slot]
        states = [state[index, :, start:end] for layer in self.runner.layers for state in (layer.keys, layer.values)]
        return torch.stack(states).unflatten(0, (len(self.runner.layers), 2))  # one copy
