#!/usr/bin/env bash
# Downloads the wheels benchmarks/gpu_check.py installs on a GPU machine (the list:
# benchmarks/gpu_wheels.txt) for its Python 3.12 on manylinux x86-64, into .whl/ at the
# repository's root (ignored by git; carried beside the tree). Prints the total size: the
# tree and the wheels travel together under 64 MiB.
#
#   bash benchmarks/gpu_wheels.sh [--with-av] [DIR]
#
# --with-av adds PyAV (video decoding, 36 MB: over the budget with the tree; the check
# needs no video).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
with_av=0
if [[ "${1:-}" == "--with-av" ]]; then with_av=1; shift; fi
dest="${1:-$root/.whl}"
mkdir -p "$dest"
mapfile -t specs < <(grep -v '^\s*#' "$root/benchmarks/gpu_wheels.txt" | sed 's/#.*//' | awk 'NF {print $1}')
if [[ $with_av == 1 ]]; then specs+=("av==18.1.0"); fi
python="${PYTHON:-python3}"
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest" "${specs[@]}"
count=$(ls "$dest"/*.whl | wc -l)
bytes=$(cat "$dest"/*.whl | wc -c)
echo "$count wheels in $dest: $((bytes / 1024 / 1024)) MiB ($bytes bytes)"
