#!/usr/bin/env bash
# Bootstrap the venv, then run the tests: the unit tests (test/registered/unit)
# and the E2E tests on live CPU servers (test/registered/e2e, a few minutes).
# Extra arguments go to pytest (paths narrow the run):
#   bash scripts/test.sh -k activation -x
#   bash scripts/test.sh test/registered/unit -q
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${SGLANG_SESSION_CACHE_VENV:-$ROOT/.venv}"

bash scripts/bootstrap.sh
echo "[test] python -m pytest -q $* (testpaths: pyproject.toml)"
exec "$VENV/bin/python" -m pytest -q "$@"
