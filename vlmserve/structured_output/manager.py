"""The engine core's side of structured output: each constrained request's matcher, which
follows its output tokens, and each step's token bitmask for the requests that sample
under a grammar. Grammars arrive compiled (compiler.py, in the front end)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch
import xgrammar as xgr

from vlmserve.reasoning.bounds import ReasoningBounds
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
    request's own stop_token_ids end it where they appear, like any answer.

    With a thinking model (`reasoning`), the grammar starts after the token that ends the
    reasoning: until then it accepts every token and masks none, and once the thinking
    budget is spent its mask admits that token alone. A request with a budget and no
    grammar (`compiled` None) is followed for the budget only."""

    def __init__(self, compiled: xgr.CompiledGrammar | None, output_token_ids: list[int], stop_token_ids: list[int],
                 reasoning: ReasoningBounds | None = None) -> None:
        self._compiled = compiled
        self._output_token_ids = output_token_ids  # the request's own list, which grows
        self._stop_token_ids = stop_token_ids
        self._matcher: xgr.GrammarMatcher | None = None
        self.reasoning = reasoning
        # where the grammar starts among the output tokens (None: still reasoning), and
        # where the reasoning's budget counts from
        self._start: int | None = 0 if reasoning is None else reasoning.answer_start(output_token_ids)
        self._counted_from = 0

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        if self._matcher is None:
            self._matcher = xgr.GrammarMatcher(self._compiled, override_stop_tokens=self._stop_token_ids or None)
            for token in self._output_token_ids[self._start:]:  # a resumed request
                if not self._matcher.accept_token(token):
                    raise RuntimeError(f"replaying token {token} into the grammar failed")
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """Advances past a generated token (it was appended to the output already)."""
        if self._start is None:  # reasoning: the grammar has not started
            if token_id == self.reasoning.end_token_id:
                self._start = len(self._output_token_ids)
            elif token_id == self.reasoning.start_token_id:
                self._counted_from = len(self._output_token_ids)
            return True
        if self._compiled is None:
            return True
        if self._matcher is None:
            self.matcher  # replays every output token, this one included
            return True
        return self._matcher.accept_token(token_id)

    @property
    def forced_token(self) -> int | None:
        """The token the next step must sample: the end of the reasoning, once its budget
        is spent."""
        r = self.reasoning
        if self._start is not None or r is None or r.budget is None:
            return None
        return r.end_token_id if len(self._output_token_ids) - self._counted_from >= r.budget else None

    def masks_next(self) -> bool:
        """Whether the next token is sampled under a mask (the grammar's, or the forced end
        of the reasoning)."""
        return (self._start is not None and self._compiled is not None) or self.forced_token is not None

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

    def request_grammar(self, spec: CompiledSpec | None, output_token_ids: list[int], stop_token_ids: list[int],
                        reasoning: ReasoningBounds | None = None) -> RequestGrammar:
        """The matcher of a request with a grammar, a thinking budget, or both."""
        return RequestGrammar(None if spec is None else self._compiled(spec), output_token_ids, stop_token_ids,
                              reasoning)

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
        xgrammar's own fill them in parallel), and a row admitting one token for each
        request whose thinking budget is spent. A request whose matcher cannot be rebuilt
        fails alone; one whose grammar admits no token at all (an unsatisfiable branch)
        ends there, its batch-mates carry on."""
        matchers, req_ids, broken, forced = [], [], {}, []
        for rid, grammar in grammars:
            token = grammar.forced_token
            if token is not None:
                forced.append((rid, token))
                continue
            try:
                matchers.append(grammar.matcher)
                req_ids.append(rid)
            except Exception as e:
                broken[rid] = f"internal error: the grammar could not follow the answer: {e}"
        bitmask = self._bitmask[: len(matchers) + len(forced)]
        finished = []
        if matchers:
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask[: len(matchers)])
            dead = (bitmask[: len(matchers)] == 0).all(dim=1).tolist()
            finished = [rid for rid, d in zip(req_ids, dead) if d]
        else:
            dead = []
        self._force(bitmask[len(matchers):], [token for _, token in forced])
        if finished:  # a dead row leaves the mask
            keep = [i for i, d in enumerate(dead) if not d] + list(range(len(matchers), len(bitmask)))
            req_ids, bitmask = [rid for rid, d in zip(req_ids, dead) if not d], bitmask[keep]
        req_ids = req_ids + [rid for rid, _ in forced]
        return StepGrammars(GrammarBitmask(req_ids, bitmask) if req_ids else None, broken, finished)

    @staticmethod
    def _force(rows: torch.Tensor, tokens: list[int]) -> None:
        """Bitmask rows admitting one token each."""
        rows.zero_()
        for row, token in zip(rows, tokens):
            row[token // 32] = torch.tensor(1 << (token % 32), dtype=torch.int64).to(torch.int32)


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
