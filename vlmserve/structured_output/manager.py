"""Compiles grammars for the engine's tokenizer in a thread of their own, never on the step
loop, and fills each step's token bitmask for the requests that sample under a grammar."""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import xgrammar as xgr

from vlmserve.sampling_params import StructuredOutputsParams
from vlmserve.structured_output.grammar import build_grammar

logger = logging.getLogger(__name__)


@dataclass
class GrammarBitmask:
    """Allowed next tokens of the requests that sample under a grammar this step: row i of
    `bitmask` (int32 words, bit t of the vocabulary = token t allowed) is req_ids[i]'s."""

    req_ids: list[str]
    bitmask: torch.Tensor  # [len(req_ids), ceil(vocab / 32)] int32


class RequestGrammar:
    """One request's grammar: compiling until `ready()`, then a matcher that follows the
    request's output tokens. `release()` drops the matcher (preemption, the end); the next
    use builds a fresh one and replays the tokens generated so far."""

    def __init__(self, compiled: Future, output_token_ids: list[int], stop_token_ids: list[int]) -> None:
        self._compiled = compiled
        self._output_token_ids = output_token_ids  # the request's own list, which grows
        self._stop_token_ids = stop_token_ids
        self._matcher: xgr.GrammarMatcher | None = None

    def ready(self) -> bool:
        return self._compiled.done()

    def error(self) -> str | None:
        """Why compilation failed (once ready), else None."""
        e = self._compiled.exception()
        return None if e is None else f"the grammar could not be compiled: {e}"

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        if self._matcher is None:
            self._matcher = xgr.GrammarMatcher(self._compiled.result(), override_stop_tokens=self._stop_token_ids)
            for token in self._output_token_ids:  # a resumed request
                if not self._matcher.accept_token(token):
                    raise RuntimeError(f"replaying token {token} into the grammar failed")
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """Advances past a generated token (it was appended to the output already)."""
        if self._matcher is None:
            self.matcher  # replays every output token, this one included
            return True
        return self._matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self._matcher is not None and self._matcher.is_terminated()

    def release(self) -> None:
        self._matcher = None


class StructuredOutputManager:
    def __init__(self, model_path: str, vocab_size: int, max_num_seqs: int, cache_size: int = 256) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._compiler: xgr.GrammarCompiler | None = None  # made in the pool, with the tokenizer
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._cache_size = cache_size
        self._batch = xgr.BatchGrammarMatcher()
        self._bitmask = xgr.allocate_token_bitmask(max_num_seqs, vocab_size)

    def grammar_for(self, spec: StructuredOutputsParams, output_token_ids: list[int],
                    stop_token_ids: list[int]) -> RequestGrammar:
        """A request's grammar; compiled in the pool unless the same spec was compiled (or
        is compiling) already."""
        future = self._cache.get(spec.key)
        if future is None or (future.done() and future.exception() is not None):
            future = self._pool.submit(self._compile, spec)
            self._cache[spec.key] = future
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        self._cache.move_to_end(spec.key)
        return RequestGrammar(future, output_token_ids, stop_token_ids)

    def _compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        if self._compiler is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler.compile_grammar(build_grammar(spec))

    def bitmask(self, grammars: list[tuple[str, RequestGrammar]]) -> tuple[GrammarBitmask | None, dict[str, str]]:
        """The bitmask of this step's sampling requests under a grammar (threads of
        xgrammar's own fill them in parallel), and the requests whose matcher could not
        be rebuilt (request id -> why): those fail alone, their batch-mates carry on."""
        matchers, req_ids, broken = [], [], {}
        for rid, grammar in grammars:
            try:
                matchers.append(grammar.matcher)
                req_ids.append(rid)
            except Exception as e:
                broken[rid] = f"internal error: the grammar could not follow the answer: {e}"
        if not matchers:
            return None, broken
        bitmask = self._bitmask[: len(matchers)]
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask)
        return GrammarBitmask(req_ids, bitmask), broken
