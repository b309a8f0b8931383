#!/usr/bin/env bash
# Builds the llama.cpp peer for side-by-side benchmarks: the llama.cpp source that the
# llama-cpp-python sdist vendors (the package registry is this machine's only network),
# compiled for this CPU (GGML_NATIVE: AVX-512, VNNI, AMX where present) into
# llama-mtmd-cli, llama-server and llama-quantize. Its converter (convert_hf_to_gguf.py)
# runs in vlmserve's own venv with the source's gguf-py on PYTHONPATH (torch and
# transformers are what it needs besides). About 15 minutes on 2 cores.
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
cmake -S "$src" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF > "$dir/cmake.log"
cmake --build "$dir/build" --config Release -j "$(nproc)" \
  --target llama-mtmd-cli llama-server llama-quantize > "$dir/build.log"
ls -la "$dir/build/bin/"
echo "llama.cpp peer: $dir/llama.cpp (binaries in $dir/build/bin)"
