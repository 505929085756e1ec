#!/usr/bin/env bash
# Installs what stria needs to build and test, and only what is missing.
# Idempotent: a second run installs nothing. Debian/Ubuntu (apt-get).
# CUDA is optional: it is detected by the build, never installed here.
# clang and its runtime libraries (libFuzzer, the sanitizers) build the fuzz
# targets of tests/fuzz.
set -euo pipefail

packages=(
  build-essential cmake pkg-config
  libucx-dev ucx-utils
  libuv1-dev
  libprotobuf-c-dev protobuf-c-compiler
  libssl-dev
  libcriterion-dev
  iproute2
  python3
  python3-venv
  python3-prometheus-client
  dpkg-dev lintian
  clang libclang-rt-dev
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-deps: missing packages (${missing[*]}) and no apt-get on this system;" >&2
  echo "install them with your package manager and re-run." >&2
  exit 1
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    sudo="sudo"
  else
    echo "install-deps: need root (or sudo) to install: ${missing[*]}" >&2
    exit 1
  fi
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "install-deps: done"
