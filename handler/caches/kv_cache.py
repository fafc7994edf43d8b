"""A Hugging Face DynamicCache for a ragged batch: rollback is a length.

Rows in one batch accept different numbers of drafts, so after a step their
caches should end at different lengths. The cache tensors are rectangular, so
each row keeps a validity mask over the cache columns: left padding and
rejected tokens are holes the attention mask hides. Positions are counted per
row from the valid tokens only, so a hole never shifts a rotary position.

- `rollback(lengths)` keeps each row's first `lengths[b]` valid tokens and
  crops the columns no row uses. The prefix is never recomputed.
- When holes take more than `COMPACT_SLACK` columns beyond the longest row,
  the rows are re-packed to the right (left padding) with one gather per layer.
- `select_rows` drops finished requests from the batch; `extend` adds
  requests prefilled in a cache of their own, so that requests can join a
  running batch (continuous batching) without padding the others' chunks.

The mask lives on the CPU: bookkeeping then needs no device synchronisation.

Sliding-window layers (Mistral's, Gemma 2's and 3's local layers) keep every
token here too, as a full layer does, so that rollback stays a length and
every layer's KV has one shape (the prefix cache copies rows of it). The
window is the attention mask's: each row's 4D mask lets a token see the
tokens fewer than `sliding_window` positions before it, counted in the row's
own positions, so holes never widen it. Where some layers slide and others
do not, the model gets one mask per layer type.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, get_layer_types_and_kwargs

from handler.sampler import host_to_device
from handler.tree import ROOT, chunk_attention

# Hole columns tolerated beyond the longest row before re-packing the cache.
COMPACT_SLACK = 16


def _padded_states(layer, name: str, num_rows: int, like, width: int) -> torch.Tensor:
    """A layer's keys or values left-padded to `width` columns; zeros when the layer holds none yet."""
    reference = getattr(like, name)  # [batch, heads, columns, head_dim]
    if not layer.is_initialized:
        return reference.new_zeros((num_rows, reference.shape[1], width, reference.shape[3]))
    states = getattr(layer, name)
    missing = width - states.shape[2]
    if missing == 0:
        return states
    padding = states.new_zeros((states.shape[0], states.shape[1], missing, states.shape[3]))
    return torch.cat([padding, states], dim=2)


FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


def layer_types(model: torch.nn.Module) -> list[str]:
    """Each decoder layer's attention type, as `transformers` builds its cache layers."""
    config = model.config.get_text_config(decoder=True)
    return get_layer_types_and_kwargs(config)[0]


def sliding_layout(model: torch.nn.Module) -> tuple[int | None, bool]:
    """The window of the model's sliding-window layers in tokens (None where no layer slides), and
    whether every layer slides."""
    kinds = set(layer_types(model))
    if SLIDING_ATTENTION not in kinds:
        return None, False
    return int(model.config.get_text_config(decoder=True).sliding_window), kinds == {SLIDING_ATTENTION}


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[batch, width, columns] bool -> the additive mask [batch, 1, width, columns] on `device`: eager
    attention adds it to the scores, SDPA takes it as is."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None].to(device)


def attention_masks(
    seen: torch.Tensor,  # [batch, width, columns] bool: what each chunk column may attend to
    kv_positions: torch.Tensor,  # [batch, columns] long: each column's position in its row
    query_positions: torch.Tensor,  # [batch, width] long
    layout: tuple[int | None, bool],  # `sliding_layout`
    dtype: torch.dtype,
    device: torch.device,
):
    """The model's attention mask: one additive mask, or with sliding-window layers theirs, which also
    hides what lies a window or more behind, and where only some layers slide, one per layer type.
    A column's own position is never a window behind it, so every column still sees itself."""
    window, all_sliding = layout
    if window is None:
        return additive_mask(seen, dtype, device)
    near = query_positions[:, :, None] - kv_positions[:, None, :] < window  # [batch, width, columns]
    sliding = additive_mask(seen & near, dtype, device)
    if all_sliding:
        return sliding
    return {FULL_ATTENTION: additive_mask(seen, dtype, device), SLIDING_ATTENTION: sliding}


def check_cache_support(model: torch.nn.Module) -> None:
    """Raises ValueError if the model's cache cannot be rolled back by cropping: a layer that is
    neither full nor sliding-window attention (state-space, linear-attention, chunked)."""
    kinds = set(layer_types(model))
    if not kinds <= {FULL_ATTENTION, SLIDING_ATTENTION}:
        cache = DynamicCache(config=model.config)
        names = sorted({type(layer).__name__ for layer in cache.layers})
        raise ValueError(
            f"{type(model).__name__} uses cache layers {names} ({', '.join(sorted(kinds))}); speculative decoding "
            "here needs full or sliding-window attention layers (state-space, linear and chunked attention caches "
            "cannot be rolled back by a length)"
        )


def _owns_its_storage(states: torch.Tensor) -> bool:
    """Whether `states` is all of its storage (in any order), not a slice of a larger tensor."""
    return states.untyped_storage().nbytes() == states.numel() * states.element_size()


class _FullLayer(DynamicLayer):
    """A layer that keeps every token, takes its first chunk's keys and values as the model made them,
    and appends later chunks in place.

    `DynamicLayer` concatenates an empty tensor with the first chunk: one more copy of a whole
    prefill's KV per layer, for nothing. States that are a slice of a larger tensor (a fused
    projection's output) are still copied: keeping them would keep all of it.

    `DynamicLayer` also concatenates every later chunk, a copy of the layer's whole KV per pass:
    at 16 rows of 500 tokens, 14 ms of a 1.5B-shaped pass on a 2-core CPU. Here a chunk is written
    into room past the layer's columns (`_room`, `_with_room`: grown by an eighth when full, so a
    pass copies a few columns' worth on average), and the keys and values are views of it. Whatever
    replaces the states (a rollback's gather, a row selection, a merge) leaves no room: the next
    chunk makes new.
    A crop keeps the room; the columns it dropped are written over by the next chunks.
    """

    _room: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            if not (_owns_its_storage(key_states) and _owns_its_storage(value_states)):
                return super().update(key_states, value_states, *args, **kwargs)
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states  # [batch, heads, width, head_dim]
            return self.keys, self.values
        columns, width = self.keys.shape[2], key_states.shape[2]
        if not self._has_room(columns + width):
            self._room = (_with_room(self.keys, 2, columns + width), _with_room(self.values, 2, columns + width))
        for room, states in zip(self._room, (key_states, value_states)):
            room[:, :, columns : columns + width] = states
        self.keys, self.values = (room[:, :, : columns + width] for room in self._room)
        return self.keys, self.values

    def _has_room(self, columns: int) -> bool:
        """Whether the keys and values are still the first columns of the room, with `columns` in it."""
        if self._room is None:
            return False
        return all(
            states.data_ptr() == room.data_ptr()
            and states.stride() == room.stride()
            and states.shape[:2] == room.shape[:2]
            and states.shape[3] == room.shape[3]
            and room.shape[2] >= columns
            for states, room in zip((self.keys, self.values), self._room)
        )


ROOM_MIN_COLUMNS = 32  # the least room an append leaves past the columns (`_with_room`)


def _with_room(states: torch.Tensor, dim: int, needed: int) -> torch.Tensor:
    """A tensor like `states` whose size along `dim` holds `needed` and an eighth more (at least
    ROOM_MIN_COLUMNS), `states` copied to its front: room that later appends write into in place
    (a cache layer's keys and values, a ragged cache's mask). Past `states` it is uninitialised:
    an append writes its columns before they are read."""
    shape = list(states.shape)
    shape[dim] = needed + max(ROOM_MIN_COLUMNS, needed // 8)
    room = states.new_empty(shape)
    room.narrow(dim, 0, states.shape[dim]).copy_(states)
    return room


def full_cache(model: torch.nn.Module) -> DynamicCache:
    """A DynamicCache whose every layer keeps every token, sliding-window layers included."""
    cache = DynamicCache(config=model.config)
    cache.layers = [_FullLayer() for _ in cache.layers]
    return cache


def tree_attention_error(model: torch.nn.Module) -> str | None:
    """Why the model cannot verify draft trees, or None when it can.

    Runs the model once on a tree of two branches with a custom 4D attention mask
    and compares each branch's logits with those of the branch run alone as a
    chain. A model that ignores or rejects the mask, or whose positions do not
    follow `position_ids`, fails here rather than in a request.
    """
    vocab_size = model.config.get_text_config().vocab_size
    context, pending = [1 % vocab_size, 2 % vocab_size], 3 % vocab_size
    first, second = [4 % vocab_size, 5 % vocab_size], [6 % vocab_size]
    try:
        with torch.inference_mode():
            chains = []
            for branch in (first, second):
                cache = prefill(model, [context], 0)
                ids = torch.tensor([[pending, *branch]])
                chains.append(cache.forward(ids, torch.ones_like(ids), logits_to_keep=ids.shape[1])[0].float())
            cache = prefill(model, [context], 0)
            ids = torch.tensor([[pending, *first, *second]])
            tree = chunk_attention([[ROOT, 0, ROOT]], 3)
            logits = cache.forward(ids, torch.ones_like(ids), logits_to_keep=4, tree=tree)[0].float()
    except Exception as error:  # noqa: BLE001 - any failure means no trees, said at start-up
        return f"{type(model).__name__} failed a forward pass with a custom 4D attention mask: {error}"
    expected = torch.cat([chains[0], chains[1][1:]])  # [4, vocab]: root, first branch, second branch
    scale = float(expected.abs().max()) or 1.0
    # Float32 differs by rounding only; half precision by a few ulps of the logits' scale.
    tolerance = 1e-4 if model.dtype == torch.float32 else 5e-2
    error = float((logits - expected).abs().max()) / scale
    if error > tolerance:
        return (
            f"{type(model).__name__} does not honour a custom 4D attention mask with its cache "
            f"(a tree's logits differ from its chains' by {error:.2g} of their scale)"
        )
    return None


def model_name(model: torch.nn.Module) -> str:
    """The model's class and, where it was loaded from one, its path or hub id: for messages."""
    path = getattr(model.config, "name_or_path", "") or ""
    return f"{type(model).__name__} ({path})" if path else type(model).__name__


# Tokens a layout probe prefills: more than one, so that a layer that does not keep one column per
# token shows it.
PROBE_TOKENS = 3
# Each probed model's layout (`cache_layout`), for as long as the model lives.
_LAYOUTS: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()


def cache_layout(model: torch.nn.Module) -> tuple[tuple[int, int, int, int, int] | None, ...]:
    """Each layer's KV as a prefill's cache holds it: (key heads, key head dim, value heads, value
    head dim, columns held after `PROBE_TOKENS` tokens), or None for a layer the prefill left empty.

    Read from the model, not from its config: a config may carry keys its modeling code ignores
    (GPT-BigCode and Falcon cache one KV head and OPT and GPT-J every head, whatever
    `num_key_value_heads` says). One prefill of a few tokens per model, remembered.
    """
    layout = _LAYOUTS.get(model)
    if layout is None:
        with torch.inference_mode():
            cache = prefill(model, [list(range(PROBE_TOKENS))], 0).cache
        layout = tuple(
            (
                layer.keys.shape[1],
                layer.keys.shape[3],
                layer.values.shape[1],
                layer.values.shape[3],
                layer.keys.shape[2],
            )
            if layer.is_initialized
            else None
            for layer in cache.layers
        )
        _LAYOUTS[model] = layout
    return layout


def kv_layout(model: torch.nn.Module) -> tuple[int, int, int]:
    """The model's cache layout as a prefill's cache holds it: (layers, key-value heads, head dim).

    Raises ValueError where no one such layout holds every layer: keys and values of one shape, the
    same in every layer, one column per token.
    """
    layout = cache_layout(model)
    first = layout[0] if layout else None
    if first is None or any(shape != first for shape in layout) or first[:2] != first[2:4] or first[4] != PROBE_TOKENS:
        raise ValueError(
            f"{model_name(model)} caches KV in no one layout (per layer, a prefill of {PROBE_TOKENS} tokens "
            f"held key heads, key head dim, value heads, value head dim, columns: {list(layout)}); "
            "a layout of slots needs one shape for keys and values in every layer, one column a token"
        )
    num_kv_heads, head_dim = first[:2]
    return len(layout), num_kv_heads, head_dim


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of keys and values one token takes in the model's cache, over all layers (as a prefill's
    cache holds them)."""
    elements = sum(
        key_heads * key_dim + value_heads * value_dim
        for key_heads, key_dim, value_heads, value_dim, _ in filter(None, cache_layout(model))
    )
    # The model's dtype, not a parameter's: an int8-quantised model still caches in its float dtype.
    element_size = torch.empty((), dtype=model.dtype).element_size()
    return elements * element_size


def left_pad(token_lists: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns input_ids [batch, width] and mask [batch, width], real tokens right-aligned."""
    width = max(len(tokens) for tokens in token_lists)
    # Built as lists, two tensors in all: a row's copy would cost a few tensor calls each.
    ids = [[pad_id] * (width - len(tokens)) + list(tokens) for tokens in token_lists]
    mask = [[0] * (width - len(tokens)) + [1] * len(tokens) for tokens in token_lists]
    shape = (len(ids), width)
    return torch.tensor(ids, dtype=torch.long).reshape(shape), torch.tensor(mask, dtype=torch.long).reshape(shape)


def chunk_of(token_lists: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`left_pad`, with no mask where every row has as many tokens (no padding): `RaggedCache.forward`
    then takes the positions from the lengths alone, without a mask's sums."""
    width = len(token_lists[0])
    if all([len(tokens) == width for tokens in token_lists]):
        return torch.tensor(token_lists, dtype=torch.long).reshape(len(token_lists), width), None
    return left_pad(token_lists, pad_id)


class RaggedCache:
    """One model's KV cache for a batch of rows of different lengths."""

    def __init__(self, model: torch.nn.Module, batch_size: int) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.cache = full_cache(model)
        self.layout = sliding_layout(model)
        self.mask = torch.zeros((batch_size, 0), dtype=torch.long)  # [batch, columns], CPU
        self.lengths = torch.zeros(batch_size, dtype=torch.long)  # [batch] valid tokens per row, CPU

    @property
    def mask(self) -> torch.Tensor:  # [batch, columns] long, CPU: 1 where a column holds a row's token
        if self._ones:
            with torch.inference_mode():  # a read outside a step writes into the step's tensors
                self._write_ones()
        return self._mask

    @mask.setter
    def mask(self, mask: torch.Tensor) -> None:
        self._mask = mask
        self._ones = 0  # columns of ones appended but not written yet (`_append_columns`)
        self._holes = None  # unknown until asked (`has_holes`)
        self._room = None  # no columns past the mask to append into (`_append_columns`)

    def _append_columns(self, chunk_mask: torch.Tensor | None, width: int) -> None:
        """Appends a chunk's `width` columns to the mask: `chunk_mask`, or ones (no padding, no new holes).

        Ones are only counted, and written when the mask is next read (`mask`): a chain of passes
        without padding (the draft loop's, the verify pass) reads no mask, and writes none until a
        rollback or a ragged pass does, in one write.
        """
        if chunk_mask is None:
            self._ones += width
            return
        self._write_ones()  # the columns counted before this chunk's come first
        self._write_columns(chunk_mask, width)

    def _write_ones(self) -> None:
        """Writes the columns of ones counted since the last write."""
        width, self._ones = self._ones, 0
        if width:
            self._write_columns(None, width)

    def _write_columns(self, chunk_mask: torch.Tensor | None, width: int) -> None:
        """Appends `width` columns to the mask as it is written: `chunk_mask`, or ones.

        In place, into room that an earlier append left past the mask, where there is some: a pass
        then writes its own columns instead of copying the whole mask (a copy per pass grows with
        the context). Views of the mask taken before stay as they were: an append writes past them.
        """
        columns = self._mask.shape[1]
        room = self._room
        if room is None or room.shape[1] < columns + width:
            room = _with_room(self._mask, 1, columns + width)
        room[:, columns : columns + width] = 1 if chunk_mask is None else chunk_mask
        holes = self._holes
        self.mask = room[:, : columns + width]
        self._room = room
        if chunk_mask is None:
            self._holes = holes

    @property
    def has_holes(self) -> bool:
        """Whether some row has a column without a token (padding, or a dropped draft)."""
        if self._holes is None:
            self._holes = not bool(self._mask.all())  # the ones not written yet hold none
        return self._holes

    @property
    def num_columns(self) -> int:
        return self._mask.shape[1] + self._ones

    def forward(
        self,
        input_ids: torch.Tensor,  # [batch, width], on any device
        chunk_mask: torch.Tensor | None,  # [batch, width] long, CPU; 0 marks left padding; None: none
        logits_to_keep: int,
        tree: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Appends a chunk of tokens to every row and returns the last logits.

        Args:
            chunk_mask: None where no row of the chunk is padded (a verify pass, a draft chain's pass):
                the positions then follow from the lengths alone.
            tree: for a chunk of draft trees (`handler.tree.chunk_attention`): which chunk
                columns each column sees ([batch, width, width] bool) and each column's depth
                ([batch, width] long). The chunk has no padding then; a column's position is
                the row's length plus its depth.

        Returns:
            logits: [batch, logits_to_keep, vocab] for the chunk's last columns.
        """
        if tree is not None:
            return self._forward_tree(input_ids, tree, logits_to_keep)
        sliding = self.layout[0] is not None
        old_mask = self.mask if sliding else None  # the columns before the chunk, for their positions
        width = input_ids.shape[1]
        if chunk_mask is None:
            position_ids = self.lengths[:, None]  # [batch, width]
            if width > 1:
                position_ids = position_ids + torch.arange(width)
            self.lengths = self.lengths + width
        else:
            assert input_ids.shape == chunk_mask.shape, (input_ids.shape, chunk_mask.shape)
            # Each real token's position is the number of valid tokens before it in its row.
            position_ids = self.lengths[:, None] + chunk_mask.cumsum(dim=1) - 1  # [batch, width]
            position_ids = position_ids.clamp(min=0)
            self.lengths = self.lengths + chunk_mask.sum(dim=1)
        self._append_columns(chunk_mask, width)
        if sliding:
            if chunk_mask is None:
                chunk_mask = self.mask.new_ones(input_ids.shape)
            old_positions = old_mask.cumsum(dim=1) - 1  # [batch, old columns]: each valid column's position
            kv_positions = torch.cat([old_positions, position_ids], dim=1)  # [batch, columns]
            seen = self.mask.bool()[:, None, :] & (kv_positions[:, None, :] <= position_ids[:, :, None])
            # A padding column sees itself only: its output is never read, and a row of nothing is NaN.
            diagonal = torch.arange(width)
            seen[:, diagonal, self.num_columns - width + diagonal] |= ~chunk_mask.bool()
            masks = attention_masks(seen, kv_positions, position_ids, self.layout, self.model.dtype, self.device)
            return self._run(input_ids, masks, position_ids, logits_to_keep)
        # Without holes (always so for one request) no mask is needed, and attention can take
        # its causal fast path instead of materialising a 4D mask on every pass.
        attention_mask = self.mask.to(self.device) if self.has_holes else None
        return self._run(input_ids, attention_mask, position_ids, logits_to_keep)

    def _forward_tree(
        self, input_ids: torch.Tensor, tree: tuple[torch.Tensor, torch.Tensor], logits_to_keep: int
    ) -> torch.Tensor:
        allowed, depth = tree  # [batch, width, width] bool, [batch, width] long
        batch_size, width = input_ids.shape
        assert allowed.shape == (batch_size, width, width) and depth.shape == (batch_size, width)
        position_ids = self.lengths[:, None] + depth  # [batch, width]
        # Each column sees the row's valid cached columns and its own ancestors in the chunk.
        seen = torch.cat([self.mask.bool()[:, None, :].expand(-1, width, -1), allowed], dim=2)  # [b, w, cols]
        kv_positions = torch.cat([self.mask.cumsum(dim=1) - 1, position_ids], dim=1)  # [batch, columns]
        self._append_columns(None, width)
        self.lengths = self.lengths + width
        masks = attention_masks(seen, kv_positions, position_ids, self.layout, self.model.dtype, self.device)
        return self._run(input_ids, masks, position_ids, logits_to_keep)

    def _run(self, input_ids, attention_mask, position_ids, logits_to_keep: int) -> torch.Tensor:
        if self.device.type != "cpu":
            input_ids, position_ids = host_to_device(input_ids, self.device), host_to_device(position_ids, self.device)
        output = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        return output.logits

    @classmethod
    def from_kv(cls, model: torch.nn.Module, kvs: Sequence[torch.Tensor | None]) -> RaggedCache:
        """A cache whose row b holds `kvs[b]` ([layers, 2, heads, tokens, head_dim], or None: nothing)."""
        cache = cls(model, len(kvs))
        lengths = [0 if kv is None else kv.shape[3] for kv in kvs]
        width = max(lengths, default=0)
        if width == 0:
            return cache
        like = next(kv for kv in kvs if kv is not None and kv.shape[3])
        num_layers, _, heads, _, head_dim = like.shape
        assert num_layers == len(cache.cache.layers), (num_layers, len(cache.cache.layers))
        states = like.new_zeros((num_layers, 2, len(kvs), heads, width, head_dim))
        cache.mask = torch.zeros((len(kvs), width), dtype=torch.long)
        for row, (kv, length) in enumerate(zip(kvs, lengths)):
            if length:  # right-aligned: the holes are left padding
                states[:, :, row, :, width - length :] = kv
                cache.mask[row, width - length :] = 1
        cache.lengths = torch.tensor(lengths, dtype=torch.long)
        for index, layer in enumerate(cache.cache.layers):
            layer.keys, layer.values = states[index, 0], states[index, 1]  # [rows, heads, width, head_dim]
            layer.dtype, layer.device, layer.is_initialized = states.dtype, states.device, True
        return cache

    def hand_to(self, model: torch.nn.Module) -> None:
        """Makes this cache `model`'s: its KV in `model`'s dtype, its passes `model`'s. For a prefill by
        another form of the same weights (a draft's float form, whose prefills outrun its int8 form's)."""
        dtype = model.dtype
        for layer in self.cache.layers:
            if layer.is_initialized and layer.keys.dtype != dtype:
                layer.keys, layer.values = layer.keys.to(dtype), layer.values.to(dtype)
                layer.dtype, layer._room = dtype, None
        self.model = model

    def row_kv(self, slot: int, start: int, end: int) -> torch.Tensor:
        """A copy of row `slot`'s KV for its valid tokens start..end-1: [layers, 2, heads, end - start, head_dim]."""
        assert 0 <= start < end <= int(self.lengths[slot]), (start, end, self.lengths[slot])
        columns = self.mask[slot].nonzero()[start:end, 0]
        first, last = int(columns[0]), int(columns[-1])
        if last - first + 1 == end - start:  # no holes in between: a slice
            index = slice(first, last + 1)
        else:
            index = columns.to(self.device)
        states = [state[slot, :, index] for layer in self.cache.layers for state in (layer.keys, layer.values)]
        # One stack of every layer's keys and values: one copy, where a stack per layer and one of
        # those would copy the KV twice.
        return torch.stack(states).unflatten(0, (len(self.cache.layers), 2))

    def rollback(self, lengths: torch.Tensor) -> None:  # [batch] long, CPU
        """Keeps each row's first `lengths[b]` valid tokens; drops the rest."""
        if not torch.equal(lengths, self.lengths):  # equal: every draft was taken, nothing to drop
            assert bool((lengths <= self.lengths).all()), (lengths, self.lengths)
            self.mask = self.mask * (self.mask.cumsum(dim=1) <= lengths[:, None])
            self.lengths = lengths.clone()
            self._crop_unused_columns()
        if self.num_columns - int(self.lengths.max()) > COMPACT_SLACK:
            self._compact()

    def keep_chunk_paths(self, chunk_width: int, paths: Sequence[Sequence[int]]) -> None:
        """After a tree pass: each row keeps its path's chunk columns, moved to the chunk's front.

        Only the chunk's columns move (one gather per layer over `chunk_width` columns);
        what follows a row's path becomes the end of the row, for `rollback` to drop.

        Args:
            chunk_width: the columns the last forward appended.
            paths: per row, the chunk columns to keep, increasing (`handler.tree.verify_tree`).
        """
        start = self.num_columns - chunk_width
        order = torch.arange(chunk_width).repeat(len(paths), 1)  # [batch, chunk_width]
        for row, path in enumerate(paths):
            assert list(path) == sorted(set(path)) and (not path or path[-1] < chunk_width), path
            kept = set(path)
            rest = [column for column in range(chunk_width) if column not in kept]
            order[row] = torch.tensor([*path, *rest])
        if bool((order == torch.arange(chunk_width)).all()):
            return  # every path is a prefix: nothing moves
        index = (start + order).to(self.device)
        for layer in self.cache.layers:
            batch, heads, _, head_dim = layer.keys.shape
            gather = index[:, None, :, None].expand(batch, heads, chunk_width, head_dim)
            layer.keys[:, :, start:] = layer.keys.gather(2, gather)
            layer.values[:, :, start:] = layer.values.gather(2, gather)

    def select_rows(self, rows: Sequence[int]) -> None:
        """Keeps only `rows`, in that order (finished requests leave the batch)."""
        index = torch.tensor(rows, dtype=torch.long)
        self.mask = self.mask[index]
        self.lengths = self.lengths[index]
        device_index = index.to(self.device)
        for layer in self.cache.layers:
            # Not batch_select_indices: it skips layers that hold zero columns, leaving the old batch size.
            if layer.is_initialized:
                layer.keys = layer.keys[device_index]
                layer.values = layer.values[device_index]
        self._crop_unused_columns()

    def extend(self, other: RaggedCache) -> None:
        """Appends `other`'s rows after this cache's rows; the narrower one is left-padded with holes."""
        assert other.device == self.device
        width = max(self.num_columns, other.num_columns)
        num_mine, num_theirs = self.mask.shape[0], other.mask.shape[0]
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            if not (mine.is_initialized or theirs.is_initialized):
                continue  # only one-token prompts so far: no columns anywhere
            like = mine if mine.is_initialized else theirs
            for name in ("keys", "values"):
                parts = [
                    _padded_states(layer, name, rows, like, width)
                    for layer, rows in ((mine, num_mine), (theirs, num_theirs))
                ]
                setattr(mine, name, torch.cat(parts))  # [rows, heads, width, head_dim]
            mine.dtype, mine.device, mine.is_initialized = like.dtype, like.device, True
        pad_mine = self.mask.new_zeros((num_mine, width - self.num_columns))
        pad_theirs = other.mask.new_zeros((num_theirs, width - other.num_columns))
        self.mask = torch.cat([torch.cat([pad_mine, self.mask], dim=1), torch.cat([pad_theirs, other.mask], dim=1)])
        self.lengths = torch.cat([self.lengths, other.lengths])

    def _crop_unused_columns(self) -> None:
        used = self.mask.any(dim=0).nonzero()
        keep = int(used.max()) + 1 if used.numel() else 0
        num_drop = self.num_columns - keep
        if num_drop > 0:
            self.cache.crop(-num_drop)
            self.mask = self.mask[:, :keep]

    def _compact(self) -> None:
        # A stable sort puts each row's holes first and keeps its valid tokens in order.
        width = int(self.lengths.max())
        order = torch.sort(self.mask, dim=1, stable=True).indices[:, -width:]  # [batch, width]
        self.mask = self.mask.gather(1, order)
        device_order = order.to(self.device)
        for layer in self.cache.layers:
            if not layer.is_initialized:
                continue
            batch, heads, _, head_dim = layer.keys.shape
            index = device_order[:, None, :, None].expand(batch, heads, width, head_dim)
            layer.keys = layer.keys.gather(2, index)
            layer.values = layer.values.gather(2, index)


def prefill(
    model: torch.nn.Module,
    prefixes: Sequence[Sequence[int]],
    pad_id: int,
    cached: Sequence[torch.Tensor | None] | None = None,
) -> RaggedCache:
    """A cache holding each prefix, one row each in order, for rows about to join a batch
    (`prefill_with_logits`, without the logits)."""
    return prefill_with_logits(model, prefixes, pad_id, cached)[0]


def prefill_with_logits(
    model: torch.nn.Module,
    prefixes: Sequence[Sequence[int]],
    pad_id: int,
    cached: Sequence[torch.Tensor | None] | None = None,
) -> tuple[RaggedCache, torch.Tensor | None]:
    """A cache holding each prefix, one row each in order, for rows about to join a batch,
    and the logits after each prefix ([rows, vocab]) where every row computed its last token;
    None otherwise.

    Args:
        cached: per row, the KV of the prefix's first tokens, found in a prefix cache
            ([layers, 2, heads, tokens, head_dim]), or None; only the rest is computed.

    Rows with an empty prefix take no part in the forward pass (a row of nothing
    but padding would attend to nothing at all) and join with no valid tokens.
    """
    cached = list(cached) if cached is not None else [None] * len(prefixes)
    num_cached = [0 if kv is None else kv.shape[3] for kv in cached]
    assert all(n <= len(prefix) for n, prefix in zip(num_cached, prefixes))
    filled = [row for row, prefix in enumerate(prefixes) if prefix]
    empty = [row for row, prefix in enumerate(prefixes) if not prefix]
    cache = RaggedCache.from_kv(model, [cached[row] for row in filled])
    suffixes = [prefixes[row][num_cached[row] :] for row in filled]
    logits = None
    if any(suffixes):
        # A row found whole in the cache takes an all-padding chunk; it attends to its cached tokens.
        input_ids, chunk_mask = left_pad(suffixes, pad_id)
        logits = cache.forward(input_ids, chunk_mask, logits_to_keep=1)[:, -1]  # [filled, vocab]
        if empty or not all(suffixes):
            logits = None  # some row's last token came from the cache, or it has none
    if empty:
        cache.extend(RaggedCache(model, len(empty)))
        if filled:
            # Back to the callers' order: position of each original row in filled + empty.
            cache.select_rows(sorted(range(len(prefixes)), key=(filled + empty).__getitem__))
    return cache, logits
