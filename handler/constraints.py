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
llguidance treats some added tokens as special (Qwen's `<tool_call>`): a grammar
reaches them by `<token>` references, and where it spells their text literally
the row takes the token as its plain-token spelling, so that masks and commits agree.

Why llguidance: measured against xgrammar and outlines-core on the demo
tokenizer (docs/structured-outputs.md): it compiles a tool schema in under a
millisecond with no per-vocabulary precomputation, fills one 151k-token mask
in about ten microseconds, rolls back by a token count, refuses a schema keyword
it cannot enforce instead of ignoring it, bounds its own work per mask
("fuel"), and installs as one wheel with no dependencies.

Nothing here imports TorchServe.
"""

from __future__ import annotations

import collections
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

    `source` is text: a JSON schema serialised as given (its property order is
    the order the output follows), the regex, or the Lark grammar.
    `field` names the request field it came from, for error messages.
    """

    kind: str
    source: str
    field: str = ""

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind

    @classmethod
    def json_schema(cls, schema: dict | bool, field: str = "json_schema") -> Constraint:
        if schema is True:
            schema = {}  # any JSON value; llguidance takes the object form only
        return cls(KIND_JSON_SCHEMA, json.dumps(schema), field)

    @classmethod
    def regex(cls, pattern: str, field: str = "regex") -> Constraint:
        return cls(KIND_REGEX, pattern, field)

    @classmethod
    def grammar(cls, lark: str, field: str = "grammar") -> Constraint:
        return cls(KIND_GRAMMAR, lark, field)

    @property
    def label(self) -> str:
        """The field to name in an error message."""
        return self.field or self.kind


def _grammar_text(constraint: Constraint) -> str:
    """llguidance's grammar for a constraint (not checked yet)."""
    import llguidance

    if constraint.kind == KIND_JSON_SCHEMA:
        return llguidance.LLMatcher.grammar_from_json_schema(
            constraint.source,
            overrides={
                "whitespace_flexible": False,
                "item_separator": JSON_ITEM_SEPARATOR,
                "key_separator": JSON_KEY_SEPARATOR,
            },
        )
    if constraint.kind == KIND_REGEX:
        return llguidance.LLMatcher.grammar_from_regex(constraint.source)
    return llguidance.LLMatcher.grammar_from_lark(constraint.source)


def check_json_schema(schema: object, field: str) -> None:
    """Raises RequestError (400, naming `field`) unless `schema` is a valid JSON Schema."""
    import jsonschema

    if not isinstance(schema, (dict, bool)):
        raise RequestError(f"{field}: must be a JSON Schema object, got {json.dumps(schema)[:80]}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        where = "/".join(str(part) for part in error.absolute_path)
        raise RequestError(
            f"{field}: not a valid JSON Schema{f' at /{where}' if where else ''}: {error.message}"
        ) from None


class GrammarCompiler:
    """Compiles constraints for one tokenizer, with an LRU cache and a time bound.

    Compiling happens while the request is parsed, inside a handler call that
    the running batch waits for. So it runs in a thread of its own and is
    abandoned after `timeout_s` (the request gets a 400); llguidance's own
    limits (`LLParserLimits`: lexer fuel, Earley items per step) bound the work
    that thread can still do, and the work of every later mask.
    """

    def __init__(self, tokenizer, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S, cache_size: int = GRAMMAR_CACHE_SIZE):
        self.ll_tokenizer = _ll_tokenizer(tokenizer)
        self.vocab_size = self.ll_tokenizer.vocab_size  # the tokenizer's; the model's may be padded past it
        # Tokens llguidance treats as special (Qwen's <tool_call> among them, though Hugging Face
        # does not). A grammar reaches them through a <token> reference; for the same text
        # spelled literally its mask may allow the special token, which the matcher then refuses.
        # Such a token is taken as its text: the matcher consumes its spelling in plain tokens.
        self.special_token_ids = tuple(t for t in range(self.vocab_size) if self.ll_tokenizer.is_special_token(t))
        self.spellings: dict[int, tuple[int, ...]] = {}
        for token_id in self.special_token_ids:
            text = tokenizer.decode([token_id])
            spelled = self.ll_tokenizer.greedy_tokenize(text) if text else []  # never a special token
            if spelled and spelled != [token_id] and all(t < self.vocab_size for t in spelled):
                self.spellings[token_id] = tuple(spelled)
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self.cache: collections.OrderedDict[Constraint, object] = collections.OrderedDict()
        self.lock = threading.Lock()
        self.num_compiled = 0  # cache misses, for tests and metrics

    def compile(self, constraint: Constraint):
        """The compiled matcher of `constraint` in its start state (shared: deep-copy it before use).

        Raises:
            RequestError: 400 naming the constraint's field, for a grammar that does not
                compile, uses something llguidance cannot enforce, or takes too long.
        """
        with self.lock:
            if constraint in self.cache:
                self.cache.move_to_end(constraint)
                return self.cache[constraint]
        matcher = self._compile_bounded(constraint)
        with self.lock:
            self.num_compiled += 1
            self.cache[constraint] = matcher
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return matcher

    def row(self, constraint: Constraint, model_vocab_size: int, eos_token_ids: Sequence[int]) -> RowGrammar:
        """A fresh matcher for one engine row."""
        return RowGrammar(
            self.compile(constraint).deep_copy(),
            self.vocab_size,
            model_vocab_size,
            eos_token_ids,
            self.special_token_ids,
            self.spellings,
        )

    def _compile_bounded(self, constraint: Constraint):
        import llguidance

        outcome: list = []

        def build() -> None:
            try:
                matcher = llguidance.LLMatcher(self.ll_tokenizer, _grammar_text(constraint), log_level=0)
                if not matcher.is_error():
                    # The first mask builds the lexer's start state: a grammar too costly for it
                    # fails here, at parse time, rather than in the running batch.
                    matcher.compute_bitmask()
                outcome.append(matcher)
            except Exception as error:  # ValueError for JSON that is not an object, and the like
                outcome.append(error)

        thread = threading.Thread(target=build, name="grammar-compile", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if not outcome:
            logger.warning("%s: compiling took over %.1f s; refused", constraint.label, self.timeout_s)
            raise RequestError(f"{constraint.label}: took longer than {self.timeout_s:g} s to compile; simplify it")
        [result] = outcome
        if isinstance(result, Exception):
            raise RequestError(f"{constraint.label}: could not be compiled ({result})") from None
        if result.is_error():
            message = result.get_error().strip().splitlines()[0] if result.get_error().strip() else "unknown error"
            raise RequestError(f"{constraint.label}: cannot be enforced: {message}")
        return result


# Per tokenizer: its compiler, or why the grammar engine cannot read it.
_COMPILERS: dict[int, tuple[object, GrammarCompiler | str]] = {}
_COMPILERS_LOCK = threading.Lock()


def _ll_tokenizer(tokenizer):
    """llguidance's view of a tokenizer: its own reader of Hugging Face tokenizers where it can read
    this one (byte-level BPE, SentencePiece with byte fallback), else the tokens' bytes
    (`handler.token_bytes`: a `Fuse` decoder, WordPiece, ...), checked against `decode`.

    Raises:
        ValueError: neither reads it; the message gives both reasons.
    """
    import llguidance
    import llguidance.hf
    from llguidance._tokenizer import TokenizerWrapper

    from handler.token_bytes import ByteVocabulary, token_bytes

    try:
        return llguidance.hf.from_tokenizer(tokenizer)
    except Exception as error:  # noqa: BLE001 - any failure: read the tokens' bytes instead
        first = f"{type(error).__name__}: {error}"
    spelled = token_bytes(tokenizer)
    if isinstance(spelled, str):
        raise ValueError(f"{first}; and as bytes: {spelled}")
    logger.info("the grammar engine reads this tokenizer from its tokens' bytes (%s)", first)
    return llguidance.LLTokenizer(TokenizerWrapper(ByteVocabulary(tokenizer, *spelled)))


def compiler_for(tokenizer, timeout_s: float | None = None) -> GrammarCompiler:
    """The one compiler of a tokenizer, shared by request parsing and the engine (built on first use, ~1 s).

    `timeout_s` sets its compile bound (the config's); None leaves the bound as it is
    (DEFAULT_COMPILE_TIMEOUT_S for a new compiler).

    Raises:
        RequestError: 400, where the grammar engine cannot read this tokenizer (llguidance reads
            byte-level and byte-fallback tokenizers, and any other whose tokens have bytes that
            `decode` agrees with: `_ll_tokenizer`). Only
            structured output needs the compiler: every other request serves. Asked once per
            tokenizer; the answer is kept.
    """
    with _COMPILERS_LOCK:
        entry = _COMPILERS.get(id(tokenizer))
        if entry is None or entry[0] is not tokenizer:
            try:
                compiler: GrammarCompiler | str = GrammarCompiler(tokenizer)
            except Exception as error:  # noqa: BLE001 - any failure to read the vocabulary means no grammars
                compiler = f"{type(error).__name__}: {error}"
            entry = (tokenizer, compiler)
            _COMPILERS[id(tokenizer)] = entry
        compiler = entry[1]
        if isinstance(compiler, str):
            raise RequestError(
                "structured output (json_schema, regex, grammar, response_format, a required or named "
                "tool_choice) is not available for this model: the grammar engine cannot read its tokenizer "
                f"({compiler})"
            )
        if timeout_s is not None:
            compiler.timeout_s = timeout_s
        return compiler


def _unpack_bitmask(bitmask: torch.Tensor, num_tokens: int) -> torch.Tensor:  # [words] int32
    """llguidance's bitmask (bit i of word w allows token 32 w + i) as bools [num_tokens]."""
    bits = (bitmask[:, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [words, 32]
    return bits.reshape(-1)[:num_tokens].bool()


class RowGrammar:
    """One row's matcher: forced tokens, draft validity and the masks of a verify pass.

    The matcher always rests at the row's committed tokens between calls;
    `masks` and drafting move it forward and roll it back by a count.
    End of sequence is the engine's to decide: the row's EOS tokens are allowed
    exactly where the grammar accepts, whatever EOS token the tokenizer names.
    """

    def __init__(
        self,
        matcher,
        tokenizer_vocab_size: int,
        model_vocab_size: int,
        eos_token_ids: Sequence[int],
        special_token_ids: Sequence[int] = (),
        spellings: dict[int, tuple[int, ...]] | None = None,
    ):
        self.matcher = matcher
        self.tokenizer_vocab_size = tokenizer_vocab_size
        self.vocab_size = model_vocab_size
        self.eos_set = frozenset(t for t in eos_token_ids if t < model_vocab_size)
        self.eos_token_ids = torch.tensor(sorted(self.eos_set), dtype=torch.long)
        self.special_token_ids = torch.tensor(
            [t for t in special_token_ids if t not in self.eos_set and t < model_vocab_size], dtype=torch.long
        )
        self.spellings = spellings or {}
        self.bitmask = torch.zeros((tokenizer_vocab_size + 31) // 32, dtype=torch.int32)
        self.num_drafted = 0  # matcher tokens consumed beyond the committed ones while drafting
        self.drafted_eos = False  # the draft model drafted an end of sequence: nothing follows it

    def mask(self) -> torch.Tensor:
        """The tokens allowed next, from the matcher's current state: bools [model vocab]."""
        self.matcher.unsafe_compute_mask_ptr(self.bitmask.data_ptr(), self.bitmask.numel() * 4)
        allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
        num_tokens = min(self.tokenizer_vocab_size, self.vocab_size)
        allowed[:num_tokens] = _unpack_bitmask(self.bitmask, num_tokens)
        # A special token is allowed only if the matcher takes it, or its spelling (rare: one look-up).
        for token_id in self.special_token_ids[allowed[self.special_token_ids]].tolist():
            if self._matcher_tokens(token_id) is None:
                allowed[token_id] = False
        accepting = self.matcher.is_accepting()
        allowed[self.eos_token_ids] = accepting
        if not accepting and not allowed.any():
            # Never seen; a safety net so that one row's grammar cannot stall the batch: end the row.
            logger.warning("grammar allows no token (%s); ending the row", self.matcher.get_error() or "stuck")
            allowed[self.eos_token_ids] = True
        return allowed

    def _matcher_tokens(self, token_id: int) -> tuple[int, ...] | None:
        """What the matcher consumes for `token_id` now: itself, its spelling, or None (refused)."""
        if self.matcher.validate_tokens([token_id]) == 1:
            return (token_id,)
        spelled = self.spellings.get(token_id)
        if spelled is not None and self.matcher.validate_tokens(list(spelled)) == len(spelled):
            return spelled
        return None

    def _try_consume(self, token_id: int) -> int | None:
        """Consumes `token_id` if the matcher takes it (or its spelling): how many matcher tokens
        that took, or None, leaving the matcher as it was."""
        tokens = self._matcher_tokens(token_id)
        if tokens is None:
            return None
        assert self.matcher.consume_tokens(list(tokens)), self.matcher.get_error()
        return len(tokens)

    def _consume(self, token_id: int) -> int:
        """Consumes `token_id`, which must be allowed; returns how many matcher tokens that took."""
        num = self._try_consume(token_id)
        if num is None:
            raise RuntimeError(f"grammar refused token {token_id}: {self.matcher.get_error()}")
        return num

    def forced_tokens(self, max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens the grammar forces next (its fast-forward tokens)."""
        if max_tokens <= 0:
            return []
        forced = [int(t) for t in self.matcher.compute_ff_tokens()[:max_tokens]]
        return forced[: self.num_valid(forced)]

    def num_valid(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids`, in order, the grammar allows from the committed state.

        An EOS token cuts the run (it is never a draft worth verifying inside a chain), and
        so does a special token the matcher refuses even as its spelling.
        """
        num, consumed = 0, 0
        for token_id in token_ids:
            taken = None if int(token_id) in self.eos_set else self._try_consume(int(token_id))
            if taken is None:
                break
            consumed += taken
            num += 1
        if consumed:
            self.matcher.rollback(consumed)
        return num

    def masks(self, draft_token_ids: Sequence[int]) -> torch.Tensor:
        """The masks of a verify pass: bools [len(drafts) + 1, model vocab].

        Row j allows what may follow the committed tokens and drafts 0..j-1.
        Every draft must be allowed (cut the chain with `num_valid` first).
        """
        assert self.num_drafted == 0
        # Positions after a drafted EOS are never emitted (the row ends there): any mask will do.
        masks = torch.ones((len(draft_token_ids) + 1, self.vocab_size), dtype=torch.bool)
        num_consumed = 0
        for j, token_id in enumerate(draft_token_ids):
            masks[j] = self.mask()
            if int(token_id) in self.eos_set:
                break
            num_consumed += self._consume(int(token_id))
        else:
            masks[len(draft_token_ids)] = self.mask()
        if num_consumed:
            self.matcher.rollback(num_consumed)
        return masks

    def draft_mask(self, previous_draft: int | None) -> torch.Tensor:
        """While the draft model drafts: the mask after the drafts so far (consume the last one first)."""
        if previous_draft is not None and not self.drafted_eos:
            if previous_draft in self.eos_set:
                self.drafted_eos = True
            else:
                self.num_drafted += self._consume(int(previous_draft))
        if self.drafted_eos:
            return torch.ones(self.vocab_size, dtype=torch.bool)
        return self.mask()

    def end_drafting(self) -> None:
        if self.num_drafted:
            self.matcher.rollback(self.num_drafted)
        self.num_drafted = 0
        self.drafted_eos = False

    def commit(self, token_ids: Sequence[int]) -> None:
        """Moves the committed state past the row's newly emitted tokens (an EOS ends the row instead)."""
        assert self.num_drafted == 0
        for token_id in token_ids:
            if token_id in self.eos_set:
                return
            self._consume(int(token_id))
