"""Structured output: a grammar as one more mask on the logits, with llguidance as the engine.

A request's `Constraint` (a JSON schema, a regex or a Lark grammar) is
compiled once into an llguidance matcher and cached (`GrammarCompiler`, an LRU
keyed by the constraint). Each constrained row of the engine holds a deep copy
(`RowGrammar`), which follows the row's committed tokens and answers, for the
verify pass, the set of tokens the grammar allows at every draft position:

- the target's logits at position j are masked to the tokens allowed after
  the committed tokens and drafts 0..j-1; the masked distribution is the
  target's distribution restricted to the grammar and renormalised, and the
  rejection sampler (or the coupling) returns exactly that;
- a draft the grammar refuses cuts the chain there (`num_valid`);
- the draft model samples under the same masks;
- the tokens the grammar forces next (`forced_tokens`, llguidance's
  fast-forward tokens) are free one-hot drafts: no draft pass proposes them.
  They are verified like any draft, since a forced *string* may still be
  spelled by several tokenizations; the target almost always picks the
  canonical one.

The matcher moves forward while masks are computed and is rolled back to the
committed length after every step (`rollback`, a length, like the caches).

Why llguidance: measured against xgrammar and outlines-core on the demo
tokenizer (docs/structured-outputs.md): it compiles a tool schema in
milliseconds with no per-vocabulary precomputation, fills one 151k-token mask
in tens of microseconds, rolls back by a token count, refuses a schema keyword
it cannot enforce instead of ignoring it, bounds its own work per mask
("fuel"), and installs as one wheel with no dependencies.

Nothing here imports TorchServe.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import logging
import threading
from typing import Sequence

import torch

from handler.schema import RequestError

logger = logging.getLogger(__name__)

KIND_JSON_SCHEMA = "json_schema"
KIND_REGEX = "regex"
KIND_GRAMMAR = "grammar"  # a Lark grammar, llguidance's dialect (it may embed %json{...} schemas)
KINDS = (KIND_JSON_SCHEMA, KIND_REGEX, KIND_GRAMMAR)

# JSON is written with these separators and no other whitespace: a model cannot
# loop on spaces or newlines, and the separators become forced tokens (free drafts).
# ", " and ": " are how the demo models (and Python's json.dumps) write JSON.
JSON_ITEM_SEPARATOR = ", "
JSON_KEY_SEPARATOR = ": "
# Compiled grammars kept (LRU); one holds a few hundred kB at most for a tool schema.
GRAMMAR_CACHE_SIZE = 128
# The default bound on compiling one constraint (handler.grammar_compile_timeout_s).
DEFAULT_COMPILE_TIMEOUT_S = 2.0


@dataclasses.dataclass(frozen=True)
class Constraint:
    """What a request's output must match.

    `source` is canonical text: a JSON schema serialised with sorted keys (so
    that equal schemas share one cache entry), the regex, or the Lark grammar.
    `field` names the request field it came from, for error messages.
    """

    kind: str
    source: str
    field: str = ""

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind

    @classmethod
    def json_schema(cls, schema: dict | bool, field: str = "json_schema") -> Constraint:
        return cls(KIND_JSON_SCHEMA, json.dumps(schema, sort_keys=True), field)
