"""Grammar-constrained decoding: what to enforce, how it is compiled (once, cached, off the engine loop), and the
per-sequence matcher that fills each step's token bitmask.

Backend: llguidance. Measured here against xgrammar (32k-token byte-level BPE, a 4-field bounded JSON schema,
2-core CPU under load): compiling took 3.6 ms vs 318 ms (llguidance builds lexer states lazily), and filling
the bitmasks of a batch of 32 sequences took 8.5 ms per step vs 20 ms (34 ms with xgrammar's batch matcher).

JSON is compact (no whitespace between tokens, "," and ":" separators), so a model cannot wander in whitespace;
with maxLength / maxItems / enum / minimum+maximum on every field an object schema has a bounded length, and
the grammar allows only EOS once the value is complete.

Flow: the server (or LLMEngine.add_request, offline) turns a `StructuredOutputsParams` into a `CompiledGrammar`
with `GrammarCompiler.compile` (cached by spec; llguidance releases the GIL while building); each sequence gets a
cheap copy of the compiled matcher; every step the engine asks each constrained sequence's matcher for its
allowed-token bitmask (`fill_bitmask`), the sampler applies all of them in one vectorised op, and the sampled
token is fed back (`accept`).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

CACHE_SIZE = 256  # compiled grammars kept (LRU)


class GrammarError(ValueError):
    """An invalid or unsupported schema / regex / grammar; the message names the problem."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What to enforce (vLLM's `structured_outputs`): exactly one of the fields."""

    json: str | dict | None = None  # a JSON schema
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None  # a Lark grammar (llguidance's dialect) or GBNF (`root ::= ...`)
    json_object: bool = False  # any JSON object

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise GrammarError("structured outputs need exactly one of json, regex, choice, grammar or json_object"
                               f" (got {', '.join(given) or 'none'})")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise GrammarError("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))

    def key(self) -> tuple[str, str]:
        """A hashable identity for the cache."""
        if self.json is not None:
            return "json", self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", "\x00".join(self.choice)
        if self.grammar is not None:
            return "grammar", self.grammar
        return "json_object", ""

    @property
    def kind(self) -> str:
        return self.key()[0]


_COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class CompiledGrammar:
    """A validated grammar bound to a tokenizer; `matcher()` gives a fresh per-sequence matcher."""

    def __init__(self, spec: StructuredOutputsParams, template: Any, vocab_size: int):
        self.spec = spec
        self._template = template  # an LLMatcher in its initial state; copies are cheap
        self.vocab_size = vocab_size

    def matcher(self) -> "GrammarMatcher":
        return GrammarMatcher(self._template.deep_copy(), self.vocab_size)


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int):
        self._m = matcher
        self.vocab_size = vocab_size

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self._m, bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False when the grammar did not allow it (the matcher is then stuck)."""
        return self._m.consume_token(token_id)

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and nothing (not even EOS) may follow, or the matcher is in an error state."""
        return self._m.is_stopped() or self._m.is_error()


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer. Thread-safe; the tokenizer's grammar view is built on
    first use (about a second for a large vocabulary), compiled grammars are cached by spec (LRU)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: set[int] | list[int]):
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()

    def _ll_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                eos = self._eos[0] if self._eos else None
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, eos_token=eos)
            return self._tokenizer

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        import llguidance

        tokenizer = self._ll_tokenizer()
        grammar = _to_llguidance(spec)
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise GrammarError(f"invalid {spec.kind.replace('_', ' ')} for structured output: {error.strip()}")
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(f"invalid {spec.kind.replace('_', ' ')} for structured output: {template.get_error()}")
        compiled = CompiledGrammar(spec, template, self.vocab_size)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled


def _to_llguidance(spec: StructuredOutputsParams) -> str:
    from llguidance import LLMatcher

    if spec.json is not None or spec.json_object:
        schema = {"type": "object"} if spec.json_object else spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=dict(_COMPACT))
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None
    if spec.regex is not None:
        return LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in spec.choice))
    text = spec.grammar
    if "::=" in text:  # GBNF (llama.cpp's, the format vLLM's xgrammar backend takes)
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except Exception as e:  # noqa: BLE001 - the converter raises its own error types
            raise GrammarError(f"invalid GBNF grammar: {e}") from None
    return LLMatcher.grammar_from_lark(text)
