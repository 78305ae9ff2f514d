#!/usr/bin/env bash
# Bootstrap the venv, then run the agentic-session benchmark on the real,
# patched UnifiedRadixCache (CPU). Extra arguments go to the benchmark.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${SGLANG_SESSION_CACHE_VENV:-$ROOT/.venv}"

bash scripts/bootstrap.sh
echo "[demo] python -m sglang_session_cache_bench.agentic $*"
exec "$VENV/bin/python" -m sglang_session_cache_bench.agentic "$@"
