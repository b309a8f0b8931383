"""A grammar vetting worker: `python -m vlmserve.structured_output.compile_worker`, started
by compiler.GrammarCompiler. It reads pickled messages on stdin — first the tokenizer
(xgrammar's TokenizerInfo as JSON), then specs — builds and compiles each spec's grammar,
checks that it admits a first token, and answers on its own stdout with ("ok", seconds)
or ("invalid", why). A compile that runs past its deadline is ended by killing the
process, which frees all it held: a thread cannot be stopped. The compiled grammar itself
stays here (xgrammar's serialized form of one can be a hundred times its size in memory);
the front end compiles a spec that passed, in a thread, knowing it finishes in time."""

from __future__ import annotations

import os
import pickle
import sys
import time


def main() -> None:
    # pickles go out on a private copy of stdout; anything a library prints goes to stderr
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    try:
        os.nice(5)  # compiles yield the cores to the engine's step loop
    except OSError:
        pass
    inp = sys.stdin.buffer

    import xgrammar as xgr

    from vlmserve.sampling_params import ParamError
    from vlmserve.structured_output.grammar import build_grammar

    info = xgr.TokenizerInfo.deserialize_json(pickle.load(inp))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    pickle.dump(("ready",), out)
    out.flush()
    while True:
        try:
            spec = pickle.load(inp)
        except EOFError:
            return
        start = time.perf_counter()
        try:
            compiled = compiler.compile_grammar(build_grammar(spec))
            matcher = xgr.GrammarMatcher(compiled)
            matcher.fill_next_token_bitmask(bitmask, 0)
            if not bool(bitmask.any()):
                raise ParamError("structured_outputs", "the grammar matches no text this model can write")
            answer = ("ok", time.perf_counter() - start)
        except ParamError as e:
            answer = ("invalid", str(e))
        except Exception as e:  # xgrammar's compile errors: the spec's fault
            answer = ("invalid", f"the grammar could not be compiled: {str(e).strip().splitlines()[0] if str(e) else e!r}")
        pickle.dump(answer, out)
        out.flush()


if __name__ == "__main__":
    main()
