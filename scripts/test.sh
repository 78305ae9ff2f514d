#!/usr/bin/env bash
# Bootstrap the venv, then run the unit tests. Extra arguments go to pytest:
#   bash scripts/test.sh -k activation -x
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${SGLANG_SESSION_CACHE_VENV:-$ROOT/.venv}"

bash scripts/bootstrap.sh
echo "[test] python -m pytest test/registered/unit -q $*"
exec "$VENV/bin/python" -m pytest test/registered/unit -q "$@"
