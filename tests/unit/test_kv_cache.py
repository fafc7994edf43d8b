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
