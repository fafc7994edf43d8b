#!/usr/bin/env python3
"""Measure the grammar engines on one tokenizer: compile time, one mask, rollback.

The engine the handler uses (llguidance) was chosen with this program. It
measures every candidate that is importable and says which are not:

    pip install llguidance==1.9.1 xgrammar==0.2.8 outlines-core==0.2.14
    python -m scripts.bench.grammar_engines --tokenizer models/qwen2.5-coder-1.5b-instruct

For each engine and each schema (a tool call, a nested extraction record):

- compile: from the JSON schema to a matcher in its start state, cold (no cache);
- mask: one token mask over the whole vocabulary, median over every position
  of a valid output, consuming the output's tokens as it goes;
- rollback: undo 4 consumed tokens (what a verify pass rejects at worst with k = 4).

Medians of several runs; a shared machine is noisy, so compare within one run.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time

logger = logging.getLogger("grammar_engines")

TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
TOOL_OUTPUT = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}}

RECORD_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "authors": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "year": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["ml", "systems", "theory", "databases"]}},
        "venue": {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"}}},
    },
    "required": ["title", "authors", "year"],
    "additionalProperties": False,
}
RECORD_OUTPUT = {
    "title": "Fast Inference from Transformers via Speculative Decoding",
    "authors": ["Yaniv Leviathan", "Matan Kalman", "Yossi Matias"],
    "year": 2023,
    "tags": ["ml", "systems"],
    "venue": {"name": "ICML", "city": "Honolulu"},
}
SCHEMAS = {"tool call": (TOOL_SCHEMA, TOOL_OUTPUT), "record": (RECORD_SCHEMA, RECORD_OUTPUT)}
ROLLBACK_TOKENS = 4


def _ms(seconds: float) -> float:
    return seconds * 1000


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer):
        import llguidance
        import llguidance.hf

        self.ll = llguidance
        started = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer)
        self.setup_s = time.perf_counter() - started
        import torch

        self.bitmask = torch.zeros((self.tokenizer.vocab_size + 31) // 32, dtype=torch.int32)

    def compile(self, schema):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), overrides={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        )
        matcher = self.ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def mask(self, matcher):
        matcher.unsafe_compute_mask_ptr(self.bitmask.data_ptr(), self.bitmask.numel() * 4)

    def consume(self, matcher, token_id):
        assert matcher.consume_token(token_id), matcher.get_error()

    def rollback(self, matcher, num_tokens):
        matcher.rollback(num_tokens)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer):
        import xgrammar

        self.xgr = xgrammar
        started = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.setup_s = time.perf_counter() - started
        self.bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)

    def compile(self, schema):
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        return self.xgr.GrammarMatcher(compiled, max_rollback_tokens=ROLLBACK_TOKENS)

    def mask(self, matcher):
        matcher.fill_next_token_bitmask(self.bitmask)

    def consume(self, matcher, token_id):
        assert matcher.accept_token(token_id)

    def rollback(self, matcher, num_tokens):
        matcher.rollback(num_tokens)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer):
        from outlines_core import Guide, Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema

        self.guide_type, self.index_type, self.to_regex = Guide, Index, build_regex_from_schema
        started = time.perf_counter()
        tokens: dict[str, list[int]] = {}
        for piece, token_id in tokenizer.get_vocab().items():
            if token_id == tokenizer.eos_token_id:
                continue
            tokens.setdefault(tokenizer.convert_tokens_to_string([piece]), []).append(token_id)
        self.vocabulary = Vocabulary(tokenizer.eos_token_id, tokens)
        self.setup_s = time.perf_counter() - started

    def compile(self, schema):
        # ", " and ": " only, as the other engines are set up.
        regex = self.to_regex(json.dumps(schema), whitespace_pattern=r"[ ]?")
        return self.guide_type(self.index_type(regex, self.vocabulary))

    def mask(self, guide):
        guide.get_tokens()

    def consume(self, guide, token_id):
        guide.advance(token_id)

    def rollback(self, guide, num_tokens):
        guide.rollback_state(num_tokens)


ENGINES = (Llguidance, Xgrammar, OutlinesCore)


def measure(engine, schema, output_ids, runs: int) -> dict:
    compile_s, mask_s, rollback_s = [], [], []
    for _ in range(runs):
        started = time.perf_counter()
        matcher = engine.compile(schema)
        compile_s.append(time.perf_counter() - started)
        for position, token_id in enumerate(output_ids):
            started = time.perf_counter()
            engine.mask(matcher)
            mask_s.append(time.perf_counter() - started)
            engine.consume(matcher, token_id)
            if position == ROLLBACK_TOKENS * 2:
                started = time.perf_counter()
                engine.rollback(matcher, ROLLBACK_TOKENS)
                rollback_s.append(time.perf_counter() - started)
                for again in output_ids[position - ROLLBACK_TOKENS + 1 : position + 1]:
                    engine.consume(matcher, again)
    return {
        "compile_ms": _ms(statistics.median(compile_s)),
        "mask_ms": _ms(statistics.median(mask_s)),
        "rollback_ms": _ms(statistics.median(rollback_s)),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default="models/qwen2.5-coder-1.5b-instruct", help="a Hugging Face folder")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    logger.info("tokenizer %s: %d tokens; %s, %s", args.tokenizer, len(tokenizer), platform.machine(), time.ctime())
    rows = []
    for engine_type in ENGINES:
        try:
            engine = engine_type(tokenizer)
        except ImportError as error:
            logger.info("%s: not installed (%s)", engine_type.name, error)
            continue
        for label, (schema, output) in SCHEMAS.items():
            output_ids = tokenizer(json.dumps(output), add_special_tokens=False)["input_ids"]
            figures = measure(engine, schema, output_ids, args.runs)
            rows.append((engine.name, label, _ms(engine.setup_s), figures))
    logger.info("| engine | schema | tokenizer setup ms | compile ms | one mask ms | rollback of 4 ms |")
    logger.info("|---|---|---|---|---|---|")
    for name, label, setup_ms, figures in rows:
        logger.info(
            "| %s | %s | %.0f | %.2f | %.3f | %.4f |",
            name,
            label,
            setup_ms,
            figures["compile_ms"],
            figures["mask_ms"],
            figures["rollback_ms"],
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
