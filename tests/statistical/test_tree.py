"""Tree verification keeps sampling exact: chi-square on the tokens a tree walk emits.

Two levels. On hand-made target distributions over a small vocabulary, each
token a walk emits follows the target's distribution given the path before
it: the first token, and the second and third along the branches the walk took.
Through the engine, an n-gram tree with two candidates for the first token
(a prompt where the matched n-gram occurs twice, followed by different tokens)
gives first tokens that follow the target, seeded (coupled) and not.

The same checks on a broken walk must fail, so they are known to have power:
the classic tree bug tries each child in turn, accepting it with the target's
probability of it as a one-hot chain would, and when all are rejected draws
from the target's distribution rather than from what the rejections left.
"""

from __future__ import annotations

import pytest
import torch

import handler.engine.verify as engine_module
from handler.config import SamplingParams
from handler.engine import GenerationRequest
from handler.sampler import sample_from_probs, warp_logits_to_probs
from handler.tree import ROOT

from .conftest import lookup_only_engine
from .test_sampler import BUG_P_VALUE, PASS_P_VALUE, chi_square_p_value

VOCAB = 8
NUM_WALKS = 20_000
# root ─┬─ 0:3 ─┬─ 2:0 ── 5:4
#       │       └─ 3:2
#       └─ 1:1 ── 4:5
TOKENS = [3, 1, 0, 2, 5, 4]
PARENTS = [ROOT, ROOT, 0, 0, 1, 2]
TARGET_LOGITS = torch.tensor(
    [
        [0.2, 1.0, -0.3, 1.3, 0.0, -1.0, 0.7, 0.1],  # root
        [1.1, 0.3, 0.9, -0.3, 0.6, 0.0, -2.0, 0.4],  # after 3
        [-0.4, 0.2, 1.0, 0.5, -0.1, 1.2, 0.3, 0.0],  # after 1
        [0.9, -0.2, 0.0, 0.4, 1.1, -0.6, 0.2, 1.0],  # after 3 0
        [0.0, 0.5, 0.5, 0.0, 0.3, 0.2, 0.1, -0.5],  # after 3 2
        [0.3, 0.1, -0.2, 0.6, 0.0, 0.4, 0.9, 0.2],  # after 1 5
        [0.5, 0.0, 0.2, 0.1, 0.8, 0.0, -0.3, 0.6],  # after 3 0 4
    ]
)  # [columns, vocab]


def buggy_verify_tree(target_probs, token_ids, parents, uniforms):
    """Each child tried in turn with the target's probability of it; all rejected: the target's plain draw."""
    children: dict[int, list[int]] = {}
    for index, parent in enumerate(parents):
        children.setdefault(parent + 1, []).append(index + 1)
    generator = torch.Generator().manual_seed(int(uniforms[0] * 2**31))
    path, emitted = [0], []
    while True:
        column = path[-1]
        for child in children.get(column, []):
            token_id = token_ids[child - 1]
            if torch.rand((), generator=generator, dtype=torch.float64) < target_probs[column, token_id]:
                path.append(child)
                emitted.append(token_id)
                break
        else:
            draw = sample_from_probs(target_probs[column][None], torch.tensor([uniforms[len(path) - 1]]))
            return path, [*emitted, int(draw[0])]


def walks(verify) -> list[list[int]]:
    probs = torch.softmax(TARGET_LOGITS / 0.8, dim=-1)  # [columns, vocab]
    generator = torch.Generator().manual_seed(0)
    uniforms = torch.rand(NUM_WALKS, 4, generator=generator, dtype=torch.float64).tolist()
    return [verify(probs, TOKENS, PARENTS, row)[1] for row in uniforms]


def p_values(emitted: list[list[int]]) -> list[float]:
    """Each emitted token against the target's distribution after the path before it."""
    probs = torch.softmax(TARGET_LOGITS / 0.8, dim=-1)
    checks = {(): 0, (3,): 1, (1,): 2, (3, 0): 3, (3, 2): 4, (1, 5): 5, (3, 0, 4): 6}
    values = []
    for prefix, column in checks.items():
        # A walk that emitted the prefix and went on (the broken walk can stop on a candidate's token).
        following = [
            tokens[len(prefix)]
            for tokens in emitted
            if len(tokens) > len(prefix) and tuple(tokens[: len(prefix)]) == prefix
        ]
        assert len(following) > 200, (prefix, len(following))
        counts = torch.bincount(torch.tensor(following), minlength=VOCAB)
        values.append(chi_square_p_value(counts, probs[column]))
    return values


def test_every_token_a_tree_walk_emits_follows_the_target():
    assert min(p_values(walks(engine_module.verify_tree))) > PASS_P_VALUE / 7


def test_the_check_catches_children_tried_in_turn_without_the_residual():
    assert min(p_values(walks(buggy_verify_tree))) < BUG_P_VALUE


NUM_SAMPLES = 3000
BATCH = 150
SAMPLING = SamplingParams(temperature=0.6, top_k=0, top_p=1.0)


@pytest.fixture(scope="module")
def tree_setup(tiny_models_dir):
    """A look-up-only engine and a prompt whose n-gram tree offers two likely first tokens."""
    engine, target = lookup_only_engine(tiny_models_dir)
    assert engine.trees
    temperature = torch.tensor([SAMPLING.temperature])
    # Prompt (a, b, x, c, a, b, y, d, a, b): the n-gram (a, b) was followed by x and by y. Pick the
    # pair whose less likely member the target likes most: both candidates must matter.
    best = None
    for x in range(10, 340):
        for y in (x + 1, (x * 7) % 330 + 10):
            prompt_ids = (20, 21, x, 22, 20, 21, y, 23, 20, 21)
            with torch.no_grad():
                logits = target(input_ids=torch.tensor([prompt_ids])).logits[:, -1:]  # [1, 1, vocab]
            probs = warp_logits_to_probs(logits, temperature, torch.tensor([0]), torch.tensor([1.0]))[0, 0]
            if x != y and (best is None or min(probs[x], probs[y]) > min(best[2][best[1][0]], best[2][best[1][1]])):
                best = (prompt_ids, (x, y), probs)
    prompt_ids, (x, y), probs = best
    return engine, prompt_ids, (x, y), probs


def first_tokens(setup, seeded: bool) -> torch.Tensor:
    engine, prompt_ids, _, _ = setup
    tokens = []
    for start in range(0, NUM_SAMPLES, BATCH):
        requests = [
            GenerationRequest(prompt_ids, 3, SAMPLING, 2, seed=start + i if seeded else None, drafter="ngram")
            for i in range(BATCH)
        ]
        results = engine.generate(requests)
        # Every row's first step verified the tree of both candidates.
        assert all(result.stats.tree_steps >= 1 for result in results)
        tokens.extend(result.token_ids[0] for result in results)
    return torch.tensor(tokens)


@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "coupled"])
def test_tree_samples_through_the_engine_follow_the_target(tree_setup, seeded, reproducible_unseeded):
    _, _, (x, y), probs = tree_setup
    assert float(probs[x]) > 0.02 and float(probs[y]) > 0.02, "both candidates must be taken sometimes"
    assert float(probs[x] + probs[y]) < 0.95, "and missed sometimes"
    counts = torch.bincount(first_tokens(tree_setup, seeded), minlength=probs.numel())
    assert 0 < counts[x] and 0 < counts[y]
    assert chi_square_p_value(counts, probs) > PASS_P_VALUE


def test_the_engine_check_catches_the_buggy_walk(tree_setup, monkeypatch, reproducible_unseeded):
    _, _, _, probs = tree_setup
    monkeypatch.setattr(engine_module, "verify_tree", buggy_verify_tree)
    counts = torch.bincount(first_tokens(tree_setup, seeded=False), minlength=probs.numel())
    assert chi_square_p_value(counts, probs) < BUG_P_VALUE
