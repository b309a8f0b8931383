"""xgrammar against llguidance on the work vlmserve gives a grammar engine: compile a JSON
schema for a tokenizer, then along a valid answer fill the next-token bitmask and accept
the token, once per token (applying the mask to the logits is the engine's own op, the
same for both). The tokenizer is a byte-level BPE of the size asked for,
trained on the Python sources of this environment (no hub here), so that the mask spans
a vocabulary like a real model's.

    python benchmarks/bench_grammar_engines.py --vocab 32000
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_flags  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "count": {"type": "integer"},
        "shapes": {"type": "array", "items": {
            "type": "object",
            "properties": {"color": {"type": "string", "enum": ["red", "green", "blue", "yellow"]},
                           "shape": {"type": "string", "enum": ["circle", "square", "triangle"]},
                           "where": {"type": "string"}},
            "required": ["color", "shape", "where"], "additionalProperties": False}},
        "note": {"type": "string"},
    },
    "required": ["count", "shapes", "note"], "additionalProperties": False,
}
ANSWER = {"count": 2, "shapes": [{"color": "red", "shape": "circle", "where": "top left"},
                                 {"color": "blue", "shape": "square", "where": "bottom right"}],
          "note": "two shapes on a white background, nothing overlaps"}


def train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(Path(torch.__file__).parent.rglob("*.py"))[:3000]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(f) for f in files], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def run_xgrammar(tokenizer, vocab: int, token_ids: list[int], any_whitespace: bool) -> tuple[float, list[float]]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=any_whitespace,
                                           separators=None if any_whitespace else (",", ":"))
    compile_s = time.perf_counter() - t0
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for t in token_ids:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        ok = matcher.accept_token(t)
        times.append(time.perf_counter() - t0)
        assert ok, f"xgrammar refused token {t}"
    return compile_s, times


def run_llguidance(tokenizer, vocab: int, token_ids: list[int], any_whitespace: bool) -> tuple[float, list[float]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    schema = dict(SCHEMA, **({} if any_whitespace else {"x-guidance": {"whitespace_flexible": False, "item_separator": ",",
                                                                         "key_separator": ":"}}))
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    matcher = llguidance.LLMatcher(lltok, grammar)
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)  # the first mask builds the lexer
    compile_s = time.perf_counter() - t0
    matcher = llguidance.LLMatcher(lltok, grammar)
    times = []
    for t in token_ids:
        t0 = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        ok = matcher.consume_token(t)
        times.append(time.perf_counter() - t0)
        assert ok, f"llguidance refused token {t}: {matcher.get_error()}"
    return compile_s, times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print("CPU:", cpu_flags())
    tokenizer = train_tokenizer(args.vocab)
    vocab = len(tokenizer)
    token_ids = tokenizer.encode(json.dumps(ANSWER, separators=(",", ":"))) + [tokenizer.eos_token_id]
    print(f"tokenizer: byte-level BPE, {vocab} tokens; answer: {len(token_ids)} tokens (compact JSON, then EOS)")
    print(f"{'engine':<12} {'whitespace':<10} {'compile (ms)':>12} {'fill+accept p50 (us)':>21} {'p90 (us)':>9}")
    for any_ws in (False, True):
        for name, fn in (("xgrammar", run_xgrammar), ("llguidance", run_llguidance)):
            compiles, per_token = [], []
            for _ in range(args.repeats):
                c, times = fn(tokenizer, vocab, token_ids, any_ws)
                compiles.append(c)
                per_token.extend(times)
            per_token.sort()
            print(f"{name:<12} {'any' if any_ws else 'compact':<10} {statistics.median(compiles) * 1e3:>12.1f} "
                  f"{statistics.median(per_token) * 1e6:>21.1f} {per_token[int(0.9 * len(per_token))] * 1e6:>9.1f}")


if __name__ == "__main__":
    main()
