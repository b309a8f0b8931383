#!/usr/bin/env bash
# Builds the llama.cpp peer for side-by-side benchmarks: the llama.cpp source that the
# llama-cpp-python sdist vendors (the package registry is this machine's only network),
# compiled for this CPU (GGML_NATIVE: AVX-512, VNNI, BF16 where present; not AMX: its tile
# kernels stop with an illegal instruction on this machine kind, `tilezero` in
# ggml_backend_amx_mul_mat, though the kernel grants the tile permission) into
# llama-mtmd-cli, llama-server and llama-quantize; and a venv for its converter
# (convert_hf_to_gguf.py: torch, transformers, sentencepiece, the source's gguf-py).
# About 10 minutes on 2 cores.
#
#   bash benchmarks/setup_llama_cpp.sh [DIR]     (default: ~/.cache/vlmserve-bench/llamacpp)
#
# The benchmarks take DIR with --llama-cpp.
set -euo pipefail
dir="${1:-$HOME/.cache/vlmserve-bench/llamacpp}"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
mkdir -p "$dir"
cd "$dir"
if [ ! -d "llama_cpp_python-$version" ]; then
  pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d .
  tar xzf "llama_cpp_python-$version.tar.gz"
fi
src="$dir/llama_cpp_python-$version/vendor/llama.cpp"
ln -sfn "$src" "$dir/llama.cpp"
no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -S "$src" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF > "$dir/cmake.log"
cmake --build "$dir/build" --config Release -j "$(nproc)" \
  --target llama-mtmd-cli llama-server llama-quantize > "$dir/build.log"
if [ ! -x "$dir/venv/bin/python" ]; then
  python3 -m venv "$dir/venv"
  "$dir/venv/bin/pip" install --quiet torch==2.14.1 "transformers>=5" numpy sentencepiece safetensors protobuf
fi
"$dir/venv/bin/pip" install --quiet "$src/gguf-py"
ls -la "$dir/build/bin/"
echo "llama.cpp peer: $dir/llama.cpp (binaries in $dir/build/bin)"
