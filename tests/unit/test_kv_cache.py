"""The ragged cache's layers: a prefill's keys and values are kept as the model made them, not copied."""

from __future__ import annotations

import torch

from handler.caches.kv_cache import _FullLayer

# [batch, heads, tokens, head_dim]
SHAPE = (2, 3, 4, 5)


def test_a_layer_keeps_its_first_chunk_as_the_model_made_it_and_appends_the_next():
    layer = _FullLayer()
    keys = torch.randn(SHAPE)
    values = torch.randn(2, 4, 3, 5).transpose(1, 2)  # a projection's output viewed per head: all of its storage
    returned = layer.update(keys, values)
    assert returned[0] is keys and returned[1] is values
    assert layer.keys is keys and layer.values is values
    more = torch.randn(2, 3, 1, 5)
    layer.update(more, more)
    assert torch.equal(layer.keys, torch.cat([keys, more], dim=2))
    assert torch.equal(layer.values, torch.cat([values, more], dim=2))


def test_a_slice_of_a_larger_tensor_is_copied_so_that_the_rest_is_not_kept():
    fused = torch.randn(2, 3, 4, 10)  # a fused projection's output: keys and values are halves of it
    layer = _FullLayer()
    layer.update(fused[..., :5], fused[..., 5:])
    for states, half in ((layer.keys, fused[..., :5]), (layer.values, fused[..., 5:])):
        assert torch.equal(states, half)
        assert states.untyped_storage().nbytes() == states.numel() * states.element_size()


def test_later_chunks_are_written_in_place_and_any_replacement_of_the_states_is_kept():
    """Chunks after the first go into room past the columns (no copy of the layer per pass); a crop keeps
    the room, whatever else replaces the states (a gather, a row selection) starts a new one; the
    keys and values always equal the concatenation of what was kept."""
    layer = _FullLayer()
    keys, values = torch.randn(SHAPE), torch.randn(SHAPE)
    layer.update(keys, values)
    expected_keys, expected_values = keys, values
    storages = set()
    for step in range(40):
        rows = layer.keys.shape[0]
        chunk_keys, chunk_values = torch.randn(rows, 3, 1 + step % 3, 5), torch.randn(rows, 3, 1 + step % 3, 5)
        before = layer.keys  # a view held across the append must not change
        before_copy = before.clone()
        layer.update(chunk_keys, chunk_values)
        assert torch.equal(before, before_copy)
        expected_keys = torch.cat([expected_keys, chunk_keys], dim=2)
        expected_values = torch.cat([expected_values, chunk_values], dim=2)
        assert torch.equal(layer.keys, expected_keys) and torch.equal(layer.values, expected_values)
        storages.add(layer.keys.untyped_storage().data_ptr())
        if step % 5 == 4:  # a rollback: the last two columns go
            layer.crop(-2)
            expected_keys, expected_values = expected_keys[:, :, :-2], expected_values[:, :, :-2]
        if step == 20:  # a row leaves: new states, the next append must not write into the old room
            old = layer._room[0]
            layer.keys, layer.values = layer.keys[[1]], layer.values[[1]]
            expected_keys, expected_values = expected_keys[[1]], expected_values[[1]]
            old_copy = old.clone()
        if step == 21:  # bit for bit: past its columns the room holds whatever memory it got, NaNs included
            assert torch.equal(old.view(torch.int32), old_copy.view(torch.int32))
        if step == 30:  # states laid out as the room is, but elsewhere (a rewrite): the room is not theirs
            fresh_keys, fresh_values = torch.empty_like(layer._room[0]), torch.empty_like(layer._room[1])
            columns = layer.keys.shape[2]
            fresh_keys[:, :, :columns], fresh_values[:, :, :columns] = 2 * layer.keys, 2 * layer.values
            layer.keys, layer.values = fresh_keys[:, :, :columns], fresh_values[:, :, :columns]
            expected_keys, expected_values = 2 * expected_keys, 2 * expected_values
    # Room grows by an eighth (at least 32 columns): a few storages over 40 appends, not one each.
    assert 2 <= len(storages) <= 6, len(storages)
