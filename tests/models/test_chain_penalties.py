"""A row whose only rules are its logit bias and penalties drafts through the draft model's chains, which
apply them on the device (`handler.logits_processors.ChainPenalties`), its drafts so far counted pass by
pass; a grammar's row still drafts through the general loop, which calls its `shape` draft by draft.

In float32 a penalised row's proposals (drafts, distributions, confidences) and the draft cache equal the
general loop's; its own history is left as it was; a drafting step of penalised rows whose drafts stay on
the device reads it once; through the engine, greedy output with penalties stays plain decoding's with
them, with the drafts left on the device or read at once.
"""

from __future__ import annotations

import pytest
import torch

from handler.config import SamplingParams
from handler.drafters import DraftRow
from handler.drafters.model import ModelDrafter
from handler.engine import GenerationRequest
from handler.engine.row import Row

from .conftest import make_engine
from .test_engine import PROMPTS, encode
from .test_logits_processors import SETTINGS
from .test_propose import sampling_batch, settings
from .test_stop_by_mask import drafter_for, fix_unseeded_generator

# Each asking row: its sampling for the draws (`settings`) and its penalties (a name of SETTINGS, or None);
# and the cache's rows that do not ask (they draft greedily, to keep the batch rectangular).
COMPOSITIONS = {
    "greedy": ({"a": (settings(0.0, 1, k=5), "all")}, ()),
    "sampled": ({"a": (settings(0.9, 2, k=5), "presence_frequency")}, ()),
    "mixed batch": (
        {
            "a": (settings(0.0, 3, k=4), "repetition"),
            "b": (settings(0.9, 4, k=5), "logit_bias"),
            "c": (settings(0.9, 5, k=3), None),
            "d": (settings(0.0, 6, k=5), "presence_frequency"),
        },
        ("e",),
    ),
}


def penalised_rows(tiny_pair, composition: dict, prompts: dict) -> dict:
    """A `Row` per penalised request, with a few committed tokens so that its counts are not all zero."""
    target, _, tokenizer = tiny_pair
    rows = {}
    for rid, (_, name) in composition.items():
        if name is not None:
            request = GenerationRequest(prompts[rid], 40, SETTINGS[name], 5)
            row = Row.start(rid, request, "model", tokenizer, (), target.config.vocab_size, torch.device("cpu"))
            row.commit([prompts[rid][-1], prompts[rid][-1], 30])
            rows[rid] = row
    return rows


def propose(drafter: ModelDrafter, composition: dict, rows: dict, on_device: bool, measure: bool) -> dict:
    """The proposals of the asking rows; a penalised row gives its `shape` and, `on_device`, its penalties."""
    sampling = {rid: setting for rid, (setting, _) in composition.items()}
    batch = sampling_batch(sampling, drafter.device)
    asking = [
        DraftRow(
            rid,
            len(sampling[rid][3]),
            slot,
            shape=rows[rid].shape_draft_logits if rid in rows else None,
            penalties=rows[rid].draft_penalties() if rid in rows and on_device else None,
            measure_confidence=measure,
        )
        for slot, rid in enumerate(sampling)
    ]
    proposals = dict(zip(sampling, drafter.propose(asking, batch)))
    for row in rows.values():
        row.end_drafting()
    return proposals


@pytest.mark.parametrize("measure", [False, True], ids=["fixed k", "confidences"])
@pytest.mark.parametrize("composition", COMPOSITIONS)
@torch.inference_mode()
def test_a_penalised_chain_proposes_what_the_general_loop_does(tiny_pair, composition, measure, monkeypatch):
    tokenizer = tiny_pair[2]
    asking, others = COMPOSITIONS[composition]
    prompts = {rid: encode(tokenizer, PROMPTS["abcde".index(rid) % len(PROMPTS)]) for rid in [*asking, *others]}
    rows = penalised_rows(tiny_pair, asking, prompts)
    histories = {rid: (row.output_counts, row.seen) for rid, row in rows.items()}
    histories = {rid: [None if t is None else t.clone() for t in pair] for rid, pair in histories.items()}
    # With confidences the chains serve the stop by mask alone: the loop's drafter reads every pass.
    chains, loop = drafter_for(tiny_pair, prompts, True), drafter_for(tiny_pair, prompts, False)
    took_chains = []
    real = ModelDrafter._propose_chains

    def spied(self, *args, **kwargs):
        took_chains.append(self is chains)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ModelDrafter, "_propose_chains", spied)
    for _ in range(2):
        took_chains.clear()
        expected = propose(loop, asking, rows, on_device=False, measure=measure)
        actual = propose(chains, asking, rows, on_device=True, measure=measure)
        assert took_chains == [True], "the penalised rows must draft through the chains, the others not"
        for rid in asking:
            assert actual[rid].token_ids == expected[rid].token_ids, rid
            if expected[rid].draft_probs is None:
                assert actual[rid].draft_probs is None, rid
            else:
                assert torch.equal(actual[rid].draft_probs, expected[rid].draft_probs), rid
            assert actual[rid].confidences == expected[rid].confidences, rid
        assert torch.equal(chains.cache.lengths, loop.cache.lengths)
        assert (chains.pending, chains.fed) == (loop.pending, loop.fed)
        for rid, row in rows.items():  # the drafts counted for the chain only, on copies
            for kept, now in zip(histories[rid], (row.output_counts, row.seen)):
                assert (kept is None and now is None) or torch.equal(kept, now), rid
        committed = {rid: [*proposal.token_ids[:2], 7] for rid, proposal in expected.items()}
        loop.observe(committed)
        chains.observe(committed)


@torch.inference_mode()
def test_the_chains_count_their_own_drafts(tiny_pair, monkeypatch):
    """The equality above has power: under presence and frequency penalties at their largest, the
    chains' drafts are all different, where without penalties they repeat, and where the chains do not
    count their own drafts (`add` a no-op, the classic bug) they repeat too."""
    from handler.logits_processors import ChainPenalties

    tokenizer = tiny_pair[2]
    asking = {"a": (settings(0.0, 1, k=12), "presence")}
    prompts = {"a": encode(tokenizer, PROMPTS[0])}
    monkeypatch.setitem(SETTINGS, "presence", SamplingParams(presence_penalty=2.0, frequency_penalty=2.0))

    def drafts(penalised: bool) -> list[int]:
        rows = penalised_rows(tiny_pair, asking, prompts) if penalised else {}
        proposal = propose(drafter_for(tiny_pair, prompts, True), asking, rows, on_device=True, measure=False)
        return proposal["a"].token_ids

    free, penalised = drafts(False), drafts(True)
    assert len(set(free)) < len(free), free  # the tiny draft repeats itself unpenalised
    assert len(set(penalised)) == len(penalised) == 12, penalised
    monkeypatch.setattr(ChainPenalties, "add", lambda self, drafts: None)
    uncounted = drafts(True)
    assert len(set(uncounted)) < len(uncounted), uncounted


NO_EOS_MAX_NEW = 30


@pytest.mark.parametrize("name", ["all", "presence_frequency", "logit_bias"])
def test_penalised_greedy_rows_read_the_device_once_a_drafting_step(tiny_pair, name):
    """With the drafts left on the device (a GPU's default), a step of penalised rows drafting with the
    model reads the device once, as an unpenalised one does; the output is plain decoding's with the
    penalties, and the drafts read at once give the same. The static runner, as on a GPU."""
    from scripts.bench.host_syncs import HostReads

    target, draft, tokenizer = tiny_pair
    sampling = SETTINGS[name]
    batch = [GenerationRequest(encode(tokenizer, p), NO_EOS_MAX_NEW, sampling, 4) for p in PROMPTS[:3]]
    plain = make_engine(target, draft, tokenizer, eos_token_ids=(), runner="static")
    unspeculated = [GenerationRequest(r.prompt_ids, NO_EOS_MAX_NEW, sampling, 0) for r in batch]
    expected = [r.token_ids for r in plain.generate(unspeculated)]
    outputs = {}
    for on_device in (True, False):
        engine = make_engine(target, draft, tokenizer, eos_token_ids=(), runner="static", speculative_tree="off")
        engine.model_drafter.drafts_on_device = on_device
        counter = HostReads("cpu", [target])
        reads = []
        real_step = engine.step

        def step(real_step=real_step, counter=counter, reads=reads):
            counter.reset()
            step_outputs = real_step()
            reads.append((counter.reads, sum(output.num_draft_tokens for output in step_outputs)))
            return step_outputs

        engine.step = step
        with counter:
            outputs[on_device] = [r.token_ids for r in engine.generate(batch)]
        drafting = [num_reads for num_reads, num_drafts in reads[1:] if num_drafts]  # the first step admits
        assert drafting, reads
        if on_device:
            assert all(num_reads == 1 for num_reads in drafting), reads
    assert outputs[True] == expected
    assert outputs[False] == expected


@pytest.mark.parametrize("name", ["all", "logit_bias"])
def test_a_penalised_plain_step_is_the_lean_pass_and_draw(tiny_pair, name, monkeypatch):
    """Rows with penalties and no grammar decode plainly through the lean pass and draw
    (`Verifier.launch_plain`), penalised from the history committed before the step: greedy, seeded
    and unseeded sampled rows give the tokens of the verifier's path at k = 0."""
    import handler.engine.engine as engine_module

    fix_unseeded_generator(monkeypatch)
    target, draft, tokenizer = tiny_pair
    penalties = SETTINGS[name]
    sampled = SamplingParams(
        temperature=0.9,
        presence_penalty=penalties.presence_penalty,
        frequency_penalty=penalties.frequency_penalty,
        repetition_penalty=penalties.repetition_penalty,
        logit_bias=penalties.logit_bias,
    )
    prompts = [encode(tokenizer, p) for p in PROMPTS[:3]]
    batch = [
        GenerationRequest(prompts[0], NO_EOS_MAX_NEW, penalties, 0),
        GenerationRequest(prompts[1], NO_EOS_MAX_NEW, sampled, 0, seed=5),
        GenerationRequest(prompts[2], NO_EOS_MAX_NEW, sampled, 0),
        GenerationRequest(prompts[0], NO_EOS_MAX_NEW, SamplingParams(), 0),
    ]
    lean = make_engine(target, draft, tokenizer, eos_token_ids=())
    launched = []
    real = lean.verifier.launch_plain
    monkeypatch.setattr(lean.verifier, "launch_plain", lambda *args: launched.append(1) or real(*args))
    got = [r.token_ids for r in lean.generate(batch)]
    assert len(launched) == NO_EOS_MAX_NEW - 1  # every step after the prefill's
    monkeypatch.setattr(engine_module, "_lean", lambda rows, lag=0: False)
    expected = [r.token_ids for r in make_engine(target, draft, tokenizer, eos_token_ids=()).generate(batch)]
    assert got == expected
