#!/usr/bin/env bash
# `single_vs_mirrored.py --preset gpu` in one call on a lent GPU machine.
#
# That machine's image has JAX, Orbax, h5py, optax and matplotlib, but not
# Keras, nor what Keras and keras_dist need beyond them; it cannot download.
#
# Here, once, from the repository's root (writes .whl/, which git ignores):
#     bash benchmarks/gpu_preset.sh wheels
# There, as the command of one call that carries .whl:
#     bash benchmarks/gpu_preset.sh run "$OUT"
# Arguments after the folder go to single_vs_mirrored.py (e.g. --repeats 3).
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
wheels)
  exclude="$(git rev-parse --git-path info/exclude)"
  mkdir -p "$(dirname "$exclude")"
  grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
  # The machine's Python is 3.12 on x86_64 (/work/.library/device/KINDS.md).
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl keras==3.15.1 optree namex
  # Published as a source archive only; pure Python.
  python3 -m pip wheel --no-deps -w .whl python-hostlist
  ;;
run)
  out="${2:?usage: bash benchmarks/gpu_preset.sh run OUT_DIR [ARGS]}"
  shift 2
  mkdir -p "$out"
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  fi
  export PYTHONUNBUFFERED=1
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
  fi
  python3 benchmarks/single_vs_mirrored.py --preset gpu --out "$out" "$@"
  ;;
*)
  echo "usage: bash benchmarks/gpu_preset.sh wheels | run OUT_DIR [ARGS]" >&2
  exit 2
  ;;
esac
