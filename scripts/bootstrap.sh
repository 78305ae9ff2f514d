#!/usr/bin/env bash
# Create or refresh the project's virtual environment, then (re)install this
# package into it. Safe to run again and again:
#   * the heavy steps (torch, pinned requirements, sglang) are skipped while a
#     stamp file matches the hash of requirements/*.txt, pyproject.toml, this
#     script and the Python version;
#   * this package is always reinstalled (a few seconds), so tests and demos run
#     the current source and a fresh sglang_session_cache.pth.
#
# Environment:
#   SGLANG_SESSION_CACHE_VENV   venv location (default: <repo>/.venv)
#   PYTHON                      interpreter for a new venv (default: python3.11, else python3)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${SGLANG_SESSION_CACHE_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
STAMP="$VENV/.sglang-session-cache.stamp"
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1

log() { echo "[bootstrap] $*"; }
die() { echo "[bootstrap] ERROR: $*" >&2; exit 1; }

pick_python() {
    if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"; return; fi
    local cand
    for cand in python3.11 python3; do
        if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys' >/dev/null 2>&1; then
            echo "$cand"; return
        fi
    done
    die "no python3.11 or python3 found on PATH"
}

mkdir -p "$VENV"
# Serialise concurrent bootstraps of the same venv (two test runs at once).
if command -v flock >/dev/null 2>&1; then
    exec 9>"$VENV/.bootstrap.lock"
    flock 9
fi

# 1. The venv.
if [[ -x "$PY" ]] && "$PY" -c 'import sys' >/dev/null 2>&1; then
    log "using existing venv $VENV ($("$PY" -c 'import platform; print("Python", platform.python_version())'))"
elif [[ -e "$PY" ]]; then
    die "$VENV exists but its python does not run; remove it and run again"
else
    BASE_PY="$(pick_python)"
    log "creating venv $VENV with $BASE_PY ($("$BASE_PY" -c 'import platform; print(platform.python_version())'))"
    "$BASE_PY" -m venv "$VENV"
fi
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || die "$VENV has Python < 3.10; sglang-session-cache needs >= 3.10"

PIP=("$PY" -m pip)
PIP_QUIET=(--progress-bar off -q)

# 2. Heavy, pinned dependencies (skipped while the stamp matches).
want_hash="$(
    {
        cat requirements/*.txt pyproject.toml scripts/bootstrap.sh
        "$PY" -c 'import sys; print(sys.version)'
    } | sha256sum | cut -d' ' -f1
)"
have_hash="$(cat "$STAMP" 2>/dev/null || true)"
if [[ "$want_hash" == "$have_hash" ]]; then
    log "dependencies up to date (stamp matches), skipping heavy installs"
else
    log "installing dependencies (stamp ${have_hash:-missing} != ${want_hash:0:12}...)"
    log "  [1/4] pip + setuptools (requirements/build.txt)"
    "${PIP[@]}" install "${PIP_QUIET[@]}" -r requirements/build.txt
    log "  [2/4] torch==2.14.1 torchvision==0.29.1"
    "${PIP[@]}" install "${PIP_QUIET[@]}" torch==2.14.1 torchvision==0.29.1
    log "  [3/4] pinned CPU requirements (requirements/cpu.txt)"
    "${PIP[@]}" install "${PIP_QUIET[@]}" -r requirements/cpu.txt
    log "  [4/4] sglang==0.5.16 --no-deps (requirements/sglang.txt)"
    "${PIP[@]}" install "${PIP_QUIET[@]}" --no-deps -r requirements/sglang.txt
    echo "$want_hash" > "$STAMP"
    log "dependencies installed; stamp written to $STAMP"
fi

# 3. This package, always (fast): current source + fresh .pth.
log "installing sglang-session-cache from $ROOT"
rm -rf "$ROOT/build"  # setuptools would otherwise re-package stale files from build/lib
"${PIP[@]}" install "${PIP_QUIET[@]}" --no-deps --no-build-isolation --force-reinstall "$ROOT"
rm -rf "$ROOT/build"
"$PY" - <<'PYEOF' || die "sglang_session_cache.pth is missing from site-packages after install"
import os, sys, sysconfig
pth = os.path.join(sysconfig.get_paths()["purelib"], "sglang_session_cache.pth")
if not os.path.isfile(pth):
    sys.exit(1)
import sglang_session_cache
print(f"[bootstrap] sglang-session-cache {sglang_session_cache.__version__} installed; autoload: {pth}")
PYEOF
log "done"
