"""Free, certain drafts are taken under the shipped planner, float32.

The scenario: a worker has served requests whose drafts the target rarely took, and its outcome
check (`handler.planning.trackers.OutcomeCheck`) has seen drafting steps run at about half
plain decoding's rate. Then a seeded request is sent twice: the second time the suffix trees,
shared across requests, hold the first answer, and its drafts are near certain and cost no draft
pass. The check's verdict, formed on the earlier drafts, must not refuse these: the repeat drafts
at 4 tokens or more a target pass, and its output is the first run's.

The verdict is set here as the earlier traffic left it (0.59 to 0.76 on the tiny pair), and the
cost table stands as given: timings on a shared machine are no test input.
"""

from __future__ import annotations

from handler.config import SamplingParams
from handler.engine import GenerationRequest
from handler.planning.cost_table import CostTable
from handler.planning.trackers import OUTCOME_MIN_STEPS, OutcomeCheck
from tests.models.conftest import make_engine
from tests.models.test_engine import encode

PROMPT = "def fibonacci(n):"
SAMPLED = SamplingParams(temperature=0.8)
NUM_TOKENS = 96
K = 8
VERDICT = 0.5  # drafting's rate over plain decoding's, as the check saw the earlier steps run
STEP_SECONDS = 0.002  # the earlier steps' seconds, each arm's


def test_a_repeated_answer_drafts_from_the_shared_trees_whatever_earlier_drafts_did(tiny_pair):
    target, draft, tokenizer = tiny_pair
    # About the tiny pair's own seconds: a verify pass of 9 tokens costs 1.4 plain ones.
    widths = (1, 2, 4, 8, 16)
    row = tuple(0.002 * (1.0 + 0.05 * (width - 1)) for width in widths)
    costs = CostTable(widths=widths, batch_sizes=(1, 2), target=(row, row), draft=(0.0004, 0.0004))
    engine = make_engine(target, draft, tokenizer, eos_token_ids=(), cost_table=costs)
    check = OutcomeCheck()
    for _ in range(OUTCOME_MIN_STEPS):
        check.observe(1, True, STEP_SECONDS, VERDICT)
        check.observe(1, False, STEP_SECONDS, 1.0)
    engine.planner.outcome_check = check  # the engine's steps leave the verdict as it is
    assert engine.suffix_drafter.options.share_across_requests
    request = GenerationRequest(encode(tokenizer, PROMPT), NUM_TOKENS, SAMPLED, K, seed=7, drafter="suffix")
    first = engine.generate([request])[0]
    again = engine.generate([request])[0]
    assert again.token_ids == first.token_ids
    tokens_per_pass = len(again.token_ids) / again.stats.target_forward_passes
    assert tokens_per_pass >= 4.0, (tokens_per_pass, engine.estimates.suffix_calibration.factor)
