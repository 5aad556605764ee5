#!/bin/sh
# The demo on a fresh machine, and all the set-up there is: installs what the build and the
# tests need and is missing (cmake, for zlib-ng under Pingora; redis-server, which the registry
# tests start), with apt as root or through sudo, then runs examples/demo.rs.
set -eu
cd "$(dirname "$0")/.."
missing=""
command -v cmake >/dev/null 2>&1 || missing="$missing cmake"
command -v redis-server >/dev/null 2>&1 || missing="$missing redis-server"
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null 2>&1; then sudo=sudo; else
    echo "demo: install$missing (apt-get install$missing) and run this again" >&2
    exit 1
  fi
  echo "demo: installing$missing"
  DEBIAN_FRONTEND=noninteractive $sudo apt-get update -qq
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi
exec cargo run --release --example demo
