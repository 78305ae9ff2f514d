"""E2E on live CPU servers, FULL+SWA tree (tiny Mellum: sliding + full layers).

``on`` runs the flag WITHOUT SGLANG_ENABLE_UNIFIED_RADIX_TREE: SGLang builds the
unified tree for hybrid SWA models anyway, so the start-up check must let it
through and the feature must work. ``off`` is stock (flag off). Both need the
test-only torch_native SWA-index workaround (test/workarounds/), an upstream
0.5.16 bug that also hits stock SGLang.
"""

import random

import pytest

from live_utils import (close, flush, generate, module_servers, reuses_previous_turn, run_session,
                        session_survives, tokens)
from sglang_session_cache_bench.live_server import LaunchedServer
from sglang_session_cache_bench.tiny_models import MELLUM_SLIDING_WINDOW

POOL = 1024
SESSION_PROMPT = 300
FLOOD = (8, 300)


@pytest.fixture(scope="module")
def servers(request):
    return module_servers(request, {
        "on": LaunchedServer("mellum", session_cache=True, unified=False,
                             max_total_tokens=POOL, name="mellum-on"),
        "off": LaunchedServer("mellum", session_cache=False, max_total_tokens=POOL,
                              name="mellum-off"),
    })


def test_hybrid_swa_gets_the_unified_tree_without_the_env_var(servers):
    log = servers["on"].log_text()
    assert "Session radix cache enabled on the unified tree (components full, swa)" in log
    assert "hybrid_swa=True" in log
    assert "ref_tokens(full/swa)=" in log or "session:" not in log


def test_multi_turn_session_reuses_previous_prompt_and_output(servers):
    url = servers["on"].url
    flush(url)  # room for the whole conversation: the module's leftovers are not its test
    recs = run_session(url, "multi", [3] + tokens(random.Random(1), 150), turns=4,
                       rng=random.Random(2), grow=MELLUM_SLIDING_WINDOW)
    for r in recs[1:]:
        assert reuses_previous_turn(r["cached"], r["prev_total"]), recs
    assert close(url, "multi").status_code == 200


def test_open_session_prefix_survives_pressure_only_with_the_flag(servers):
    cached_on, need = session_survives(servers["on"].url, "keeper", SESSION_PROMPT, FLOOD)
    cached_off, _ = session_survives(servers["off"].url, "keeper", SESSION_PROMPT, FLOOD)
    print(f"FULL+SWA pool={POOL}: cached on={cached_on} off={cached_off} of {need}")
    assert cached_on >= need
    assert cached_off < need // 2
