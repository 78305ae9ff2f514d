"""With every flag of ours off, the patched process is stock sglang 0.5.16,
op by op, for every cache shape (issue 12 item 2).

``flag_off_ops.py all`` runs the same seeded operation sequences on FULL (page
1 and 4), FULL+SWA, FULL+Mamba, FULL+SWA+Mamba, FULL+SWA+Mamba with the Mamba
extra buffer (the real ``ScheduleBatch.maybe_evict_swa`` decode path, where
the SWA retain floor would act) and the hybrid SWA pool sizing (where the
floor's pool re-sizing would act) and ``ServerArgs`` built from keywords and
from a stock command line (its ``vars``, which ``/get_server_info`` returns),
in two fresh interpreters started in
parallel: patched (this package's hook and plugin active, flag off) and stock
(``SGLANG_SESSION_CACHE_DISABLE=1``). Every recorded step must be equal:
eviction results, SWA frees (per-request eviction frontiers), free slots of
every allocator, evictable/protected sizes, tree contents, pool sizes,
server arguments.
"""

import json
import os
import subprocess
import sys

import pytest

from flag_off_ops import SHAPES

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def runs():
    procs = {}
    for label, disable in (("stock", "1"), ("patched", None)):
        env = {k: v for k, v in os.environ.items()
               if k not in ("SGLANG_SESSION_CACHE_DISABLE", "SGLANG_PLUGINS",
                            "SGLANG_SESSION_CACHE_AUTOLOAD")}
        if disable:
            env["SGLANG_SESSION_CACHE_DISABLE"] = disable
        procs[label] = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "flag_off_ops.py"), "all"],
            env=env, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    for label, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{label}: {stderr[-4000:]}"
        out[label] = json.loads(stdout.strip().splitlines()[-1])
    assert out["stock"]["patched"] is False, "control run must be unpatched sglang"
    assert out["patched"]["patched"] is True
    return out


@pytest.mark.parametrize("shape", SHAPES)
def test_flag_off_is_stock_op_by_op(runs, shape):
    stock, ours = runs["stock"]["traces"][shape], runs["patched"]["traces"][shape]
    assert isinstance(stock, list), f"stock run failed: {stock}"
    assert isinstance(ours, list), f"patched run failed: {ours}"
    assert len(ours) == len(stock) > (1 if shape == "server_args" else 10)
    for i, (a, b) in enumerate(zip(stock, ours)):
        assert a == b, f"{shape}: first difference at step {i}: stock {a!r} != patched {b!r}"


def test_traces_exercise_what_the_flags_gate(runs):
    """The sequences reach the gated code: admissions that evict, SWA frees
    during decode with the extra buffer, and pool sizes where the floor's
    minimum would have moved tokens to the SWA pool."""
    traces = runs["stock"]["traces"]
    full = traces["full"]
    assert any(row[1] == "evict" and row[2][0] > 0 for row in full if len(row) > 2)
    starts = [row for row in full if len(row) > 2 and row[1] == "start"]
    assert any(row[2] > 0 for row in starts)  # prefix reuse happened
    decodes = [row for row in traces["extra_buffer"] if row[0] == "decode"]
    assert any(max(row[2]) > 0 for row in decodes)  # decode freed SWA slots
    assert any("swa_max_total_num_tokens" in row[2] for row in traces["pool_sizes"])
