"""Converts a benchmark checkpoint to GGUF with llama.cpp's own converter, in the venv
that benchmarks/setup_llama_cpp.sh made: the language model in bf16 and its vision
projector (mmproj, f16 as llama.cpp ships them), then llama-quantize's Q8_0 and Q4_K_M.

    ~/.cache/vlmserve-bench/llamacpp/venv/bin/python benchmarks/llama_cpp_convert.py CHECKPOINT OUTDIR

What it is given, where it refuses the benchmark checkpoints as they are (released Qwen
checkpoints need neither):
- the published tensor names (`visual.*`, `model.*`, `lm_head.*`): transformers 5 saves
  `model.visual.*` and `model.language_model.*`, and the converter's vision side looks
  for `visual.*` only, so a renamed copy is written beside the GGUF files (once);
- the tokenizer's pre-tokenizer: the converter recognises a BPE tokenizer by hashing how
  it encodes a test text and knows only published tokenizers. The benchmark checkpoints'
  small tokenizer is byte-level BPE with GPT-2's split pattern (tokenizer.json: ByteLevel,
  use_regex), which is llama.cpp's "gpt-2" pre-tokenizer: it is told so."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

LLAMA_CPP = Path.home() / ".cache" / "vlmserve-bench" / "llamacpp"


def pre_tokenizer(checkpoint: Path) -> str:
    pre = json.loads((checkpoint / "tokenizer.json").read_text())["pre_tokenizer"]
    if pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        raise SystemExit(f"{checkpoint}: not a byte-level BPE tokenizer with GPT-2's pattern ({pre}); "
                         f"convert it with convert_hf_to_gguf.py directly")
    return "gpt-2"


def published_name(name: str) -> str:
    if name.startswith("model.visual."):
        return name.removeprefix("model.")
    return name.replace("model.language_model.", "model.", 1)


def published_layout(checkpoint: Path, out: Path) -> Path:
    """A copy of the checkpoint with its tensors under the published names."""
    from safetensors.torch import load_file, save_file

    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for file in checkpoint.iterdir():
        if file.suffix == ".safetensors":
            tensors = load_file(str(file))
            renamed = {published_name(name): t for name, t in tensors.items()}
            save_file(renamed, str(out / file.name), metadata={"format": "pt"})
        elif file.name == "model.safetensors.index.json":
            index = json.loads(file.read_text())
            index["weight_map"] = {published_name(k): v for k, v in index["weight_map"].items()}
            (out / file.name).write_text(json.dumps(index))
        elif file.is_file():
            (out / file.name).write_bytes(file.read_bytes())
    return out


def convert(checkpoint: Path, out: Path, *flags: str) -> None:
    """Runs convert_hf_to_gguf.py in a child process with the pre-tokenizer answered."""
    source = LLAMA_CPP / "llama.cpp"
    code = (f"import sys; sys.path.insert(0, {str(source)!r}); sys.argv = {['convert_hf_to_gguf.py', str(checkpoint), '--outfile', str(out), *flags]!r}\n"
            f"from conversion.base import TextModel\n"
            f"TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre_tokenizer(checkpoint)!r}\n"
            f"import runpy; runpy.run_path({str(source / 'convert_hf_to_gguf.py')!r}, run_name='__main__')")
    subprocess.run([sys.executable, "-c", code], check=True)


def main() -> None:
    checkpoint, outdir = Path(sys.argv[1]), Path(sys.argv[2])
    outdir.mkdir(parents=True, exist_ok=True)
    bf16, mmproj = outdir / "model-bf16.gguf", outdir / "mmproj-f16.gguf"
    if not (bf16.exists() and mmproj.exists()):
        checkpoint = published_layout(checkpoint, outdir / "published")
    if not bf16.exists():
        convert(checkpoint, bf16, "--outtype", "bf16")
    if not mmproj.exists():
        convert(checkpoint, mmproj, "--mmproj", "--outtype", "f16")
    for kind in ("Q8_0", "Q4_K_M"):
        target = outdir / f"model-{kind}.gguf"
        if not target.exists():
            subprocess.run([str(LLAMA_CPP / "build" / "bin" / "llama-quantize"), str(bf16), str(target), kind],
                           check=True, stdout=subprocess.DEVNULL)
    shutil.rmtree(outdir / "published", ignore_errors=True)  # only the converter reads it
    print(outdir)


if __name__ == "__main__":
    main()
