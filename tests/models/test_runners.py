"""The runners (handler.runners): the static runner's batch gives the dynamic one's logits, float32.

Each test drives both through the same sequence of the batch-cache interface (chunks
with padding, rollbacks, rows leaving and joining, tree passes with their paths kept)
and compares the logits of every real column. The engine's own exactness under the
static runner is the model tier run with `--runner static` (`make test`).
"""

from __future__ import annotations

import pytest
import torch

from handler import runners
from handler.caches.kv_cache import RaggedCache, prefill
from handler.runners.static import COLUMN_STEP, StaticRunner, width_bucket
from handler.tree import chunk_attention

from .conftest import KVCopies

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
TOLERANCE = 1e-4


@pytest.fixture
def target(tiny_pair):
    return tiny_pair[0]


def both(target, prompts, **options) -> tuple[RaggedCache, runners.BatchCache]:
    return prefill(target, prompts, 0), StaticRunner(target, **options).adopt(prefill(target, prompts, 0))


def assert_same(dynamic, static, input_ids, chunk_mask, keep, tree=None) -> None:
    expected = dynamic.forward(input_ids, chunk_mask, keep, tree=tree)
    logits = static.forward(input_ids, chunk_mask, keep, tree=tree)
    assert logits.shape == expected.shape
    real = chunk_mask[:, -keep:, None].bool()  # padding columns' logits are nobody's
    assert float(((logits - expected).abs() * real).max()) < TOLERANCE
    assert static.lengths.tolist() == dynamic.lengths.tolist()


@torch.inference_mode()
def test_ragged_chunks_rollbacks_and_rows_leaving_and_joining(target):
    dynamic, static = both(target, PROMPTS)
    ids = torch.tensor([[0, 20, 21], [22, 23, 24], [0, 0, 25]])
    assert_same(dynamic, static, ids, torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]]), keep=3)
    lengths = torch.tensor([7, 3, 5])
    dynamic.rollback(lengths)
    static.rollback(lengths)
    assert_same(dynamic, static, torch.tensor([[30], [31], [32]]), torch.ones(3, 1, dtype=torch.long), keep=1)
    dynamic.select_rows([2, 0])
    static.select_rows([2, 0])
    joining = [[40, 41, 42, 43, 44]]
    dynamic.extend(prefill(target, joining, 0))
    static.extend(prefill(target, joining, 0))
    assert static.slots == [2, 0, 1]  # the freed slot is taken again
    assert_same(dynamic, static, torch.tensor([[1, 2], [3, 4], [5, 6]]), torch.ones(3, 2, dtype=torch.long), keep=2)
    assert torch.equal(static.row_kv(2, 0, 5), dynamic.row_kv(2, 0, 5))


@torch.inference_mode()
def test_a_dense_pass_keeps_only_the_logits_asked_for(target):
    """Every slot holds a row and no column pads (the dense path): 3 columns, the last 2 kept, as the
    draft model asks where a row feeds two pending tokens and one guess."""
    dynamic, static = both(target, PROMPTS[:2])
    assert width_bucket(3) == 3
    assert_same(dynamic, static, torch.tensor([[20, 21, 22], [23, 24, 25]]), torch.ones(2, 3, dtype=torch.long), keep=2)


@pytest.mark.parametrize("num_nodes", [3, 8])  # widths 4 (no padding) and 9 (padded to 10)
@torch.inference_mode()
def test_tree_passes_and_their_kept_paths(target, num_nodes):
    dynamic, static = both(target, PROMPTS)
    parents = [
        [-1, *range(num_nodes - 1)],  # a chain
        [-1, 0, *([-1] * (num_nodes - 2))],  # a branch, then siblings of the root's children
        [-1, -1, 0, 1, *range(2, num_nodes - 2)][:num_nodes],  # two interleaved branches
    ]
    assert width_bucket(num_nodes + 1) >= num_nodes + 1
    tree = chunk_attention(parents, num_nodes)
    ids = torch.arange(num_nodes + 1).repeat(3, 1) + 50
    assert_same(dynamic, static, ids, torch.ones_like(ids), keep=num_nodes + 1, tree=tree)
    # Root-to-node paths (`handler.tree.verify_tree`'s): the whole chain, a sibling, a second branch.
    paths = [list(range(num_nodes + 1)), [0, 3], [0, 2, 4] if num_nodes > 3 else [0, 2]]
    dynamic.keep_chunk_paths(num_nodes + 1, paths)
    static.keep_chunk_paths(num_nodes + 1, paths)
    lengths = dynamic.lengths - (num_nodes + 1) + torch.tensor([len(path) for path in paths])
    dynamic.rollback(lengths)
    static.rollback(lengths)
    assert_same(dynamic, static, torch.tensor([[9], [9], [9]]), torch.ones(3, 1, dtype=torch.long), keep=1)


@torch.inference_mode()
def test_the_buffers_grow_and_keep_what_they_hold(target):
    dynamic, static = both(target, PROMPTS[:1], num_slots=1, num_columns=COLUMN_STEP)
    runner = static.runner
    long_chunk = torch.arange(2 * COLUMN_STEP)[None] % 300 + 3
    assert_same(dynamic, static, long_chunk, torch.ones_like(long_chunk), keep=1)
    assert runner.num_columns >= 2 * COLUMN_STEP + len(PROMPTS[0])
    for prompt in PROMPTS[1:]:
        dynamic.extend(prefill(target, [prompt], 0))
        static.extend(prefill(target, [prompt], 0))
    assert runner.num_slots >= 3
    ids = torch.tensor([[60], [61], [62]])
    assert_same(dynamic, static, ids, torch.ones_like(ids), keep=1)


@pytest.mark.parametrize("layout", ["one length", "lengths apart", "holes"])
@torch.inference_mode()
def test_joining_rows_take_one_copy_per_layer_for_keys_and_one_for_values(target, layout):
    """However many rows join, their KV goes into the slots in one copy per layer for the keys and one
    for the values, nothing copied on the way: rows of one length, rows of different lengths, and rows
    with holes between a prefix cache's part and the prefilled rest."""
    prompts = {"one length": [[5, 6, 7, 8]] * 4, "lengths apart": PROMPTS, "holes": PROMPTS}[layout]
    cached = None
    if layout == "holes":  # the first row's first 4 tokens from a prefix cache, the others' none
        cached = [prefill(target, [PROMPTS[0][:4]], 0).row_kv(0, 0, 4), None, None]
    running = [[1, 2, 3]]  # a row in flight: the joining rows' slots follow its
    dynamic = prefill(target, running, 0)
    static = StaticRunner(target, num_slots=8).adopt(prefill(target, running, 0))
    joining = prefill(target, prompts, 0, cached)
    assert (layout == "holes") == bool((joining.mask.cumsum(dim=1) * (1 - joining.mask)).any())
    with KVCopies() as copies:
        static.extend(joining)
    assert copies.total == 2 * len(static.runner.layers), copies.calls
    dynamic.extend(prefill(target, prompts, 0, cached))
    for row, prompt in enumerate(prompts, start=1):
        assert torch.equal(static.row_kv(row, 0, len(prompt)), dynamic.row_kv(row, 0, len(prompt)))
    ids = torch.arange(len(prompts) + 1)[:, None] + 40
    assert_same(dynamic, static, ids, torch.ones_like(ids), keep=1)


def test_graphs_need_cuda(target):
    with pytest.raises(AssertionError, match="CUDA"):
        StaticRunner(target, graphs=True)


def test_auto_chooses_one_of_the_runners_and_the_named_ones_stand(target, tiny_pair):
    draft = tiny_pair[1]
    assert runners.resolve_runner("auto", [target, draft], 5) in (runners.DYNAMIC, runners.STATIC)
    assert runners.resolve_runner("static", [target, None], 5) == runners.STATIC
    assert runners.resolve_runner("dynamic", [target], 5) == runners.DYNAMIC
    with pytest.raises(ValueError, match="runner"):
        runners.make_runner("paged", target)


class ReplayedPass:
    """A stand-in for a CUDA graph on the CPU: replay runs the captured pass again and writes its
    logits into the same output tensor, as a replay overwrites a graph's static output."""

    def __init__(self, runner: StaticRunner, num_kept: int, num_columns: int) -> None:
        self.runner, self.num_kept, self.num_columns = runner, num_kept, num_columns
        self.record = None

    def replay(self) -> None:
        logits = self.runner._pass(**self.record.inputs, num_kept=self.num_kept, num_columns=self.num_columns)
        self.record.logits.copy_(logits)


def replayed_runner(target, monkeypatch) -> tuple[StaticRunner, list[tuple[int, int, int, int]]]:
    """A static runner whose graphs are `ReplayedPass`es; the list collects the shapes captured."""
    from handler.runners import static

    runner = StaticRunner(target)
    runner.graphs = True
    captured = []

    def capture(batch_size, width, num_kept, num_columns):
        captured.append((batch_size, width, num_kept, num_columns))
        inputs = {
            "input_ids": torch.zeros((batch_size, width), dtype=torch.long),
            "positions": torch.zeros((batch_size, width), dtype=torch.long),
            "lengths": torch.zeros(batch_size, dtype=torch.long),
            "offsets": torch.zeros((batch_size, width), dtype=torch.long),
            "allowed": torch.ones((batch_size, width, width), dtype=torch.bool),
        }
        vocab = target.config.vocab_size
        fake = ReplayedPass(runner, num_kept, num_columns)
        fake.record = static._Graph(fake, inputs, torch.zeros((batch_size, num_kept, vocab)))
        return fake.record

    monkeypatch.setattr(runner, "_capture", capture)
    return runner, captured


@torch.inference_mode()
def test_replayed_graphs_give_the_eager_logits_and_returned_logits_survive_the_next_replay(target, monkeypatch):
    runner, captured = replayed_runner(target, monkeypatch)
    dynamic, static = prefill(target, PROMPTS[:1], 0), runner.adopt(prefill(target, PROMPTS[:1], 0))
    first = static.forward(torch.tensor([[20]]), torch.ones(1, 1, dtype=torch.long), 1)
    expected = dynamic.forward(torch.tensor([[20]]), torch.ones(1, 1, dtype=torch.long), 1)
    kept = first.clone()
    second = static.forward(torch.tensor([[21]]), torch.ones(1, 1, dtype=torch.long), 1)
    assert float((first - expected).abs().max()) < TOLERANCE
    assert torch.equal(first, kept)  # a copy: the second replay of the same graph left it alone
    assert (
        float((second - dynamic.forward(torch.tensor([[21]]), torch.ones(1, 1, dtype=torch.long), 1)).abs().max())
        < TOLERANCE
    )
    assert len(captured) == 1  # one shape, captured once, replayed twice


@torch.inference_mode()
def test_the_least_recently_replayed_graph_goes_first(target, monkeypatch):
    from handler.runners import static as static_module

    monkeypatch.setattr(static_module, "MAX_GRAPHS", 2)
    runner, captured = replayed_runner(target, monkeypatch)
    batch = runner.adopt(prefill(target, PROMPTS[:1], 0))
    for width in (1, 2, 1, 3, 1, 2):  # 2 is evicted by 3, and captured again
        ids = torch.arange(width)[None] + 30
        batch.forward(ids, torch.ones_like(ids), 1)
    assert [shape[1] for shape in captured] == [1, 2, 3, 2]
    assert len(runner._graphs) == 2


def test_attended_columns_are_bucketed_finely_then_coarsely():
    from handler.runners.static import column_bucket

    assert [column_bucket(n) for n in (1, 128, 129, 2048, 2049, 3073)] == [128, 128, 256, 2048, 3072, 4096]
