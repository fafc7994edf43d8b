"""Drafts left on the device until the step's read (`handler.drafters.DeviceDrafts`, `DeviceChain`)."""

from __future__ import annotations

import pytest
import torch

from handler.drafters import DeviceDrafts, Proposal


class CountedTensor:
    """A [rows, k] tensor that counts its reads to the host."""

    def __init__(self, rows: list[list[int]]) -> None:
        self.values = torch.tensor(rows)
        self.shape = self.values.shape
        self.reads = 0

    def tolist(self) -> list[list[int]]:
        self.reads += 1
        return self.values.tolist()

    def __getitem__(self, index):
        return self.values[index]


def test_a_chain_knows_its_length_and_slices_without_a_read():
    tensor = CountedTensor([[5, 6, 7], [8, 9, 10]])
    drafts = DeviceDrafts(tensor)
    chain = drafts.chain(1, 3)
    prefix = Proposal(chain).prefix(2).token_ids
    fed = chain[: len(chain) - 1]
    assert (len(chain), len(prefix), len(fed), len(chain[:0])) == (3, 2, 2, 0)
    assert torch.equal(prefix.device_tokens, torch.tensor([8, 9]))  # on the device, as the verify pass takes it
    assert tensor.reads == 0 and not drafts.resolved


def test_the_steps_read_resolves_every_chain_of_the_loop():
    tensor = CountedTensor([[5, 6, 7], [8, 9, 10]])
    drafts = DeviceDrafts(tensor)
    chains = [drafts.chain(0, 3), drafts.chain(1, 2)]
    drafts.resolve([[5, 6, 7], [8, 9, 10]])
    assert [list(chain) for chain in chains] == [[5, 6, 7], [8, 9]]
    assert (chains[0][1], chains[0][-1], chains[1][1:]) == (6, 7, [9])
    assert chains[1] == [8, 9] and chains[1] != [8, 9, 10]
    assert [*chains[0][:2], *chains[1]] == [5, 6, 8, 9]
    with pytest.raises(IndexError):
        chains[1][2]  # the loop drew it, but the chain ends before it
    assert tensor.reads == 0


def test_a_chain_nobody_read_reads_itself_once():
    """Asked for its tokens before any verdict read them (a drafter driven on its own), a loop's drafts
    are read then, once for every chain, and are right."""
    tensor = CountedTensor([[1, 2], [3, 4]])
    drafts = DeviceDrafts(tensor)
    first, second = drafts.chain(0, 2), drafts.chain(1, 1)
    assert (list(first), list(second), repr(second)) == ([1, 2], [3], "DeviceChain([3])")
    assert tensor.reads == 1
