"""The engine core's side of structured output: each constrained request's matcher, which
follows its output tokens, and each step's token bitmask for the requests that sample
under a grammar. Grammars arrive compiled (compiler.py, in the front end)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch
import xgrammar as xgr

from vlmserve.structured_output.compiler import CompiledSpec
from vlmserve.structured_output.grammar import build_grammar

logger = logging.getLogger(__name__)


@dataclass
class GrammarBitmask:
    """Allowed next tokens of the requests that sample under a grammar this step: row i of
    `bitmask` (int32 words, bit t of the vocabulary = token t allowed) is req_ids[i]'s."""

    req_ids: list[str]
    bitmask: torch.Tensor  # [len(req_ids), ceil(vocab / 32)] int32


@dataclass
class StepGrammars:
    """What the grammars say before a step samples."""

    bitmask: GrammarBitmask | None
    broken: dict[str, str]  # request id -> why its matcher could not be rebuilt (an internal fault)
    finished: list[str]  # requests whose grammar admits no further token: their answer is complete


class RequestGrammar:
    """One request's matcher, following the request's output tokens. `release()` drops it
    (preemption, the end); the next use builds a fresh one and replays the tokens
    generated so far. The grammar ends only on the model's end-of-sequence token: a
    request's own stop_token_ids end it where they appear, like any answer."""

    def __init__(self, compiled: xgr.CompiledGrammar, output_token_ids: list[int], stop_token_ids: list[int]) -> None:
        self._compiled = compiled
        self._output_token_ids = output_token_ids  # the request's own list, which grows
        self._stop_token_ids = stop_token_ids
        self._matcher: xgr.GrammarMatcher | None = None

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        if self._matcher is None:
            self._matcher = xgr.GrammarMatcher(self._compiled, override_stop_tokens=self._stop_token_ids or None)
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
    def __init__(self, model_path: str, vocab_size: int, max_num_seqs: int, cache_size: int = 64) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiled_here: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._batch = xgr.BatchGrammarMatcher()
        self._bitmask = xgr.allocate_token_bitmask(max_num_seqs, vocab_size)

    def request_grammar(self, spec: CompiledSpec, output_token_ids: list[int],
                        stop_token_ids: list[int]) -> RequestGrammar:
        return RequestGrammar(self._compiled(spec), output_token_ids, stop_token_ids)

    def _compiled(self, spec: CompiledSpec) -> xgr.CompiledGrammar:
        """The spec's grammar: as the front end compiled it, or — an engine core in a
        process of its own, which receives specs only — compiled here once per spec (the
        front end has vetted it: it compiles within the deadline)."""
        if spec.grammar is not None:
            return spec.grammar
        compiled = self._compiled_here.get(spec.key)
        if compiled is None:
            if self._compiler is None:
                self._compiler = xgr.GrammarCompiler(tokenizer_info(self.model_path, self.vocab_size), max_threads=1,
                                                     cache_enabled=False)
            compiled = self._compiler.compile_grammar(build_grammar(spec.spec))
            self._compiled_here[spec.key] = compiled
            if len(self._compiled_here) > self._cache_size:
                self._compiled_here.popitem(last=False)
        self._compiled_here.move_to_end(spec.key)
        return compiled

    def step_grammars(self, grammars: list[tuple[str, RequestGrammar]]) -> StepGrammars:
        """The bitmask of this step's sampling requests under a grammar (threads of
        xgrammar's own fill them in parallel). A request whose matcher cannot be rebuilt
        fails alone; one whose grammar admits no token at all (an unsatisfiable branch)
        ends there, its batch-mates carry on."""
        matchers, req_ids, broken = [], [], {}
        for rid, grammar in grammars:
            try:
                matchers.append(grammar.matcher)
                req_ids.append(rid)
            except Exception as e:
                broken[rid] = f"internal error: the grammar could not follow the answer: {e}"
        if not matchers:
            return StepGrammars(None, broken, [])
        bitmask = self._bitmask[: len(matchers)]
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask)
        dead = (bitmask == 0).all(dim=1)
        finished = []
        if bool(dead.any()):
            finished = [rid for rid, d in zip(req_ids, dead.tolist()) if d]
            keep = [i for i, d in enumerate(dead.tolist()) if not d]
            req_ids = [req_ids[i] for i in keep]
            bitmask = bitmask[keep]
        return StepGrammars(GrammarBitmask(req_ids, bitmask) if req_ids else None, broken, finished)


def tokenizer_info(model_path: str, vocab_size: int) -> xgr.TokenizerInfo:
    """The tokenizer as xgrammar reads it (the same in the front end and the core)."""
    from transformers import AutoTokenizer

    return tokenizer_info_of(AutoTokenizer.from_pretrained(model_path), vocab_size)


def tokenizer_info_of(tokenizer, vocab_size: int) -> xgr.TokenizerInfo:
    """xgrammar's view of the tokenizer, where a token the answer's text leaves out (a
    special one, which the detokenizer skips) has no text: xgrammar never allows such a
    token, but reads `<|im_start|>` as twelve characters of a JSON string when the
    tokenizer does not list it among its special tokens, and the answer's text then
    lost them (`"name": ""` under `minLength: 1`). The end-of-sequence tokens still end
    the grammar."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    skipped = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    skipped.update(tokenizer.all_special_ids)
    decoded = info.decoded_vocab
    for token_id in skipped:
        if token_id < len(decoded):
            decoded[token_id] = b""
    return xgr.TokenizerInfo(decoded, xgr.VocabType.RAW, vocab_size=info.vocab_size,
                             stop_token_ids=info.stop_token_ids, add_prefix_space=info.add_prefix_space)
