"""Constrained decoding in the worker: grammars compiled off the step loop, one matcher per
request, the next-token bitmask filled beside the forward pass.

A request arrives with a `Constraint` (the gateway checked it). `attach` starts its compile on
a small thread pool, or finds it in the cache (keyed by the constraint's hash: a compiled
matcher in its start state, copied per request). Each step, for the requests that sample:

- `masks` (once the forward pass is launched) fills each ready request's row of the step's
  int32 bitmask (llguidance: about 3 µs a row for SmolLM2's 49,152 tokens) and returns the
  ruled-out tokens of each row as booleans;
- the sampler masks those rows after the penalties, before temperature and the warpers
  (TGI's order), and the runner advances the matcher with the token it took (`accept`).

A request whose compile has not ended samples nothing in that step: the scheduler recomputes
its last token next step (the others never wait for it). A compile that fails or outlasts
`compile_timeout_s` ends that request alone, with the reason. After preemption or failover
a request arrives with its generated tokens; its matcher is rebuilt by consuming them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from llguidance import LLExecutor, LLMatcher, LLTokenizer

from shared.grammar import GrammarError, compile_matcher, load_tokenizer
from shared.messages import Constraint

log = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept (start-state matchers; small)
PARALLEL_ROWS = 32  # more constrained rows than this in a step: filled on llguidance's threads


@dataclass
class RequestGrammar:
    """One request's constraint on this worker."""

    constraint: Constraint
    compiled: Future[LLMatcher]  # the grammar's start-state matcher (shared; copied here)
    attached_at: float  # monotonic s when the request arrived with it
    replay: list[int] = field(default_factory=list)  # tokens generated before (resumed)
    matcher: LLMatcher | None = None  # this request's, once compiled and caught up
    error: str = ""  # why it cannot go on (compile failure, timeout)

    @classmethod
    def failed(cls, constraint: Constraint, error: str) -> RequestGrammar:
        never: Future[LLMatcher] = Future()
        return cls(constraint, never, time.monotonic(), error=error)


class GrammarEngine:
    """Compiles constraints (cache, pool, timeout) and keeps the requests' matchers."""

    def __init__(
        self,
        tokenizer_folder: Path,
        vocab_size: int,
        eos_token_ids: list[int],
        compile_timeout_s: float = 10.0,
        metrics: Any = None,
    ) -> None:
        self.vocab_size = vocab_size  # logits columns (the model's, padding included)
        self.compile_timeout_s = compile_timeout_s
        self.metrics = metrics  # WorkerMetrics or None
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
        self.executor = LLExecutor(num_threads=2)
        self.cache: OrderedDict[str, Future[LLMatcher]] = OrderedDict()
        self.lock = threading.Lock()
        # the tokenizer's token table takes up to a second for a large vocabulary: built once,
        # at load, beside the model (the first constrained request does not pay for it)
        self.tokenizer: Future[LLTokenizer] = self.pool.submit(
            load_tokenizer, tokenizer_folder, vocab_size, eos_token_ids
        )

    # --- compile -------------------------------------------------------------------------

    def attach(self, constraint: Constraint, generated_ids: list[int]) -> RequestGrammar:
        """The request's grammar: compiled (or compiling) once per constraint key."""
        with self.lock:
            compiled = self.cache.get(constraint.key)
            if compiled is not None:
                self.cache.move_to_end(constraint.key)
                self._count("cache_hit")
            else:
                self._count("cache_miss")
                compiled = self.pool.submit(self.build, constraint)
                self.cache[constraint.key] = compiled
                while len(self.cache) > CACHE_SIZE:
                    self.cache.popitem(last=False)
        return RequestGrammar(constraint, compiled, time.monotonic(), list(generated_ids))

    def build(self, constraint: Constraint) -> LLMatcher:
        """The constraint compiled for this tokenizer: a matcher in its start state (run on
        the pool). Raises GrammarError."""
        started = time.perf_counter()
        try:
            matcher = compile_matcher(self.tokenizer.result(), constraint)
        except GrammarError:
            self._forget(constraint.key)  # not cached: the next request gets the error anew
            raise
        seconds = time.perf_counter() - started
        if self.metrics is not None:
            self.metrics.grammar_compile_seconds.observe(seconds)
        log.debug(
            "compiled %s grammar %s in %.1f ms", constraint.kind, constraint.key[:12], seconds * 1e3
        )
        return matcher

    def _forget(self, key: str) -> None:
        """A failed compile is not cached: the next request with it gets the error anew."""
        with self.lock:
            self.cache.pop(key, None)

    def settle(self, grammar: RequestGrammar) -> bool:
        """True when the request's matcher is ready; sets `error` when it never will be."""
        if grammar.matcher is not None or grammar.error:
            return grammar.matcher is not None
        if not grammar.compiled.done():
            waited = time.monotonic() - grammar.attached_at
            if waited > self.compile_timeout_s:
                grammar.error = (
                    f"the grammar did not compile within {self.compile_timeout_s:g} s "
                    "(--grammar-compile-timeout)"
                )
                self._count("timeout")
            return False
        try:
            matcher = grammar.compiled.result().deep_copy()
        except Exception as exc:  # a compile error ends this request only
            grammar.error = f"the grammar could not be built: {exc}"
            self._count("error")
            return False
        if grammar.replay and not matcher.consume_tokens(grammar.replay):  # resumed: catch up
            grammar.error = f"the tokens generated before break the grammar: {matcher.get_error()}"
            return False
        grammar.matcher = matcher
        return True

    # --- per step ------------------------------------------------------------------------

    def masks(
        self, grammars: list[RequestGrammar | None], device: torch.device
    ) -> dict[int, torch.Tensor]:
        """Row -> the tokens ruled out (bool [vocab], True = masked) for each sampling
        request (one row each, in order) whose grammar is ready. Called once the forward
        pass is launched: on CUDA the rows are filled while the GPU computes; on the CPU,
        where the pass holds every core, right after it (a helper thread would only take
        cores from it)."""
        owners = [
            (row, grammar)
            for row, grammar in enumerate(grammars)
            if grammar is not None and self.settle(grammar)
        ]
        if not owners:
            return {}
        started = time.perf_counter()
        bitmask = np.full((len(owners), (self.vocab_size + 31) // 32), -1, np.int32)
        width = bitmask.shape[1] * 4
        matchers = [grammar.matcher for _, grammar in owners if grammar.matcher is not None]
        if len(matchers) > PARALLEL_ROWS:  # llguidance's threads, without the GIL
            rows = [(matcher, i) for i, matcher in enumerate(matchers)]
            self.executor.unsafe_compute_mask_ptr(rows, bitmask.ctypes.data, width, len(rows))
        else:
            for i, matcher in enumerate(matchers):
                matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data + i * width, width)
        if self.metrics is not None:
            self.metrics.grammar_mask_seconds.observe(time.perf_counter() - started)
        ruled_out = torch.from_numpy(unpack(~bitmask, self.vocab_size)).to(device)
        masks = {}
        for i, (row, grammar) in enumerate(owners):
            assert grammar.matcher is not None
            if grammar.matcher.is_error():  # a grammar can exhaust its limits as it goes
                grammar.error = f"the grammar failed: {grammar.matcher.get_error()}"
                self._count("error")
            else:
                masks[row] = ruled_out[i]
        return masks

    @staticmethod
    def accept(grammar: RequestGrammar, token_id: int) -> str:
        """Advance the request's matcher; "" or why the token broke the grammar."""
        assert grammar.matcher is not None
        if grammar.matcher.consume_token(token_id):
            return ""
        return f"the sampled token {token_id} breaks the grammar: {grammar.matcher.get_error()}"

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.grammar_compiles.labels(outcome).inc()


def unpack(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """int32 bitmask rows -> bool rows [rows, vocab_size] (bit i of word w is token 32w + i)."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
    return bits[:, :vocab_size].astype(bool)
