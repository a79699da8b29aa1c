"""Structured outputs' grammar engine: llguidance grammars compiled once per text, one matcher per
sequence, token masks filled for each step while the backend runs it.

    HTTP handler   GrammarCompiler.compile(spec) -> Grammar      cached by (kind, text); GrammarError -> 400
    engine thread  GrammarMasks.add(seq_id, grammar)             a matcher of its own per sequence
                   GrammarMasks.attach(step input)               a TokenMask on each constrained chunk that samples,
                     helper thread: fill the masks               ... while backend.step runs; the sampler waits on them
                   GrammarMasks.consume(seq_id, token)           advance the matcher by the sampled token

A matcher lives as long as its request, so a sequence that is preempted and recomputed keeps its
grammar state: its output tokens are the same, only their KV is recomputed.
"""
from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
from llguidance import LLMatcher

from hetcore.backend import StepInput, TokenMask

KINDS = ("json_schema", "regex", "choice", "grammar")
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON as OpenAI's outputs print it (one space after `,` and `:`, no newlines): a small model given free
whitespace can spend its whole max_tokens on it."""
MAX_CACHED = 512


class GrammarError(ValueError):
    """A grammar that does not compile: the reason, and where in the schema when it has a place."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: str
    """json_schema, regex, choice or grammar (Lark, or GBNF as llama.cpp writes it)."""
    text: str
    """The schema as JSON (its key order kept: properties are generated in that order), the regex, the choices as a JSON list, or the grammar."""
    param: str = field(default="", compare=False)
    """The request parameter it came from, named in errors."""

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind

    @classmethod
    def json_schema(cls, schema: Any, param: str) -> GrammarSpec:
        return cls("json_schema", json.dumps(schema), param)


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar: matchers are copies of one template, which keeps llguidance's lexer caches warm."""

    template: LLMatcher
    num_words: int
    """int32 words of its token masks: ceil(vocab / 32)."""

    def matcher(self) -> LLMatcher:
        return self.template.deep_copy()


def _pointer(path) -> str:
    return "/" + "/".join(str(p).replace("~", "~0").replace("/", "~1") for p in path)


def _find_key(node: Any, keys: set[str], path: tuple = ()) -> tuple | None:
    """The path of the first object in `node` that has one of `keys`."""
    if isinstance(node, dict):
        if keys & node.keys():
            return path
        items = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return None
    for k, v in items:
        found = _find_key(v, keys, (*path, k))
        if found is not None:
            return found
    return None


def check_schema(schema: Any) -> None:
    """Raises GrammarError unless `schema` is a valid JSON Schema (draft 2020-12's meta-schema)."""
    import jsonschema

    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"a JSON schema is an object, got {type(schema).__name__}")
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(
        jsonschema.Draft202012Validator.META_SCHEMA).iter_errors(schema))
    if error is not None:
        raise GrammarError(f"invalid JSON schema at {_pointer(error.absolute_path)}: {error.message}")


def _engine_error(spec: GrammarSpec, message: str) -> GrammarError:
    message = message.strip().splitlines()[0] if spec.kind == "json_schema" else message.strip()
    if spec.kind == "json_schema":
        keys = set(re.findall(r'"([^"]+)"', message)) if "Unimplemented keys" in message else set()
        where = _find_key(json.loads(spec.text), keys) if keys else None
        at = f" at {_pointer(where)}" if where is not None else ""
        return GrammarError(f"unsupported JSON schema{at}: {message}")
    return GrammarError(f"{spec.kind} does not compile: {message}")


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer, keeping the last MAX_CACHED; safe to call from any thread."""

    def __init__(self, hf_tokenizer, eos_token_ids, on_compile: Callable[[float, bool], None] = lambda s, c: None):
        """on_compile(seconds, is_cached) is called for every compile (metrics)."""
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=sorted(eos_token_ids))
        self.num_words = (self.tokenizer.vocab_size + 31) // 32
        self._cache: OrderedDict[GrammarSpec, Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self.on_compile = on_compile

    def compile(self, spec: GrammarSpec) -> Grammar:
        t0 = time.perf_counter()
        with self._lock:
            grammar = self._cache.get(spec)
            if grammar is not None:
                self._cache.move_to_end(spec)
        is_cached = grammar is not None
        if grammar is None:
            grammar = Grammar(self._matcher(spec), self.num_words)
            with self._lock:
                self._cache[spec] = grammar
                while len(self._cache) > MAX_CACHED:
                    self._cache.popitem(last=False)
        self.on_compile(time.perf_counter() - t0, is_cached)
        return grammar

    def _matcher(self, spec: GrammarSpec) -> LLMatcher:
        if spec.kind == "json_schema":
            check_schema(json.loads(spec.text))
            text = LLMatcher.grammar_from_json_schema(spec.text, overrides=JSON_OPTIONS)
        else:
            try:
                text = llguidance.grammar_from(spec.kind, spec.text)
            except ValueError as exc:
                raise GrammarError(f"{spec.kind} does not compile: {exc}") from None
        matcher = LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise _engine_error(spec, matcher.get_error())
        return matcher


class GrammarMasks:
    """The engine's side: each constrained sequence's matcher, and the masks of each step."""

    def __init__(self, on_mask: Callable[[float], None] = lambda s: None):
        """on_mask(seconds) is called once a step with the time its masks took (metrics)."""
        self._matchers: dict[int, tuple[LLMatcher, int]] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._pending: Future | None = None
        self.on_mask = on_mask

    def add(self, seq_id: int, grammar: Grammar) -> None:
        self._matchers[seq_id] = (grammar.matcher(), grammar.num_words)

    def remove(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)

    def attach(self, inp: StepInput) -> StepInput:
        """`inp` with a TokenMask on every chunk that samples for a constrained sequence, filled on the helper thread."""
        self.settle()
        if not self._matchers:
            return inp
        jobs, chunks = [], []
        for c in inp.chunks:
            entry = self._matchers.get(c.seq_id) if c.sampling is not None else None
            if entry is None:
                chunks.append(c)
                continue
            masks = tuple(TokenMask() for _ in range(c.num_draft + 1))
            drafts = c.token_ids[len(c.token_ids) - c.num_draft:] if c.num_draft else ()
            jobs.append((*entry, masks, drafts))
            chunks.append(replace(c, allowed_tokens=masks[0], draft_masks=masks[1:]))
        if not jobs:
            return inp
        self._pending = self._pool.submit(self._fill, jobs)
        return replace(inp, chunks=tuple(chunks))

    def _fill(self, jobs: list[tuple[LLMatcher, int, tuple[TokenMask, ...], tuple[int, ...]]]) -> None:
        """Each job's masks: the first from its matcher's state; with drafts, each next one from a copy of the
        matcher advanced over the drafts before it (after a draft the grammar refuses, the rows copy the last
        mask: the draft is rejected there anyway)."""
        t0 = time.perf_counter()
        for matcher, num_words, masks, drafts in jobs:
            try:
                state, words = matcher, None
                for i, mask in enumerate(masks):
                    if i and state is not None:
                        if state is matcher:
                            state = matcher.deep_copy()
                        if not state.consume_token(drafts[i - 1]) or state.is_error():
                            state = None
                    if state is not None:
                        words = np.empty(num_words, np.int32)
                        state.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
                        if state.is_error():
                            for rest in masks[i:]:
                                rest.fail(state.get_error())
                            break
                    mask.fill(words)
            except Exception as exc:  # the sampler must not wait for ever
                for mask in masks:
                    mask.fail(f"{type(exc).__name__}: {exc}")
        self.on_mask(time.perf_counter() - t0)

    def settle(self) -> None:
        """Wait for the masks being filled (the matchers must not move while they are read)."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def consume(self, seq_id: int, token: int) -> str | None:
        """Advance the sequence's matcher by its sampled token. Returns "stop" once the grammar is complete
        (only end-of-sequence could follow), an error message if the token broke it, else None."""
        entry = self._matchers.get(seq_id)
        if entry is None:
            return None
        self.settle()
        matcher = entry[0]
        if not matcher.consume_token(token) or matcher.is_error():
            return f"sampled token {token} does not match the grammar: {matcher.get_error()}"
        return "stop" if matcher.is_stopped() else None

    def is_incomplete(self, seq_id: int) -> bool:
        """The sequence has a grammar its tokens so far do not complete (its output would not match it)."""
        entry = self._matchers.get(seq_id)
        if entry is None:
            return False
        self.settle()
        return not entry[0].is_accepting()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
