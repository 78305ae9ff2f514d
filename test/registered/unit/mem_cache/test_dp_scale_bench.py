"""The N-rank benchmark (``sglang_session_cache_bench.dp_scale``) on real caches."""

from __future__ import annotations

import json

import pytest

from sglang_session_cache_bench import agentic, dp_scale
from sglang_session_cache_bench.trace import GeneratorConfig, generate_trace


@pytest.fixture(scope="module")
def trace():
    return generate_trace(GeneratorConfig(
        sessions=12, concurrency=8, turns=5, system_prompt=64, task=(32, 64),
        tool_output=(32, 128), oneshot_body=(32, 128), seed=5))


def _pool(trace, ranks):
    return ranks * agentic.min_pool_tokens(trace) * 2


def test_router_methods():
    rr = dp_scale.Router("round_robin", 3, inflight=4, busy_floor=0)
    assert [rr.route(None, 10, 10, 0) for _ in range(4)] == [0, 1, 2, 0]
    tt = dp_scale.Router("total_tokens", 2, inflight=2, busy_floor=0)
    assert tt.route(None, 100, 100, 0) == 0
    assert tt.route(None, 10, 10, 0) == 1
    assert tt.route(None, 10, 10, 0) == 1  # still lighter; then the 100 leaves the window
    assert tt.tokens == [0, 20]
    aff = dp_scale.Router("affinity", 2, inflight=8, busy_floor=0, overload_factor=0)
    first = aff.route("s", 10, 10, 0)
    assert all(aff.route("s", 10, 10, t) == first for t in range(1, 5))
    assert aff.route(None, 10, 10, 5) == 0 and aff.route(None, 10, 10, 6) == 1
    aff.close("s")
    assert aff.affinity.rank_of("s") is None
    with pytest.raises(ValueError):
        dp_scale.Router("nope", 2, 4, 0)


def test_affinity_keeps_sessions_whole_and_beats_round_robin(trace):
    pool = _pool(trace, 2)
    rr = dp_scale.replay_dp(trace, "full", pool, 2, "round_robin")
    aff = dp_scale.replay_dp(trace, "full", pool, 2, "affinity", overload_factor=0)
    for run in (rr, aff):
        assert run.issues == []
        assert run.prompt_tokens == sum(len(r.prompt) for r in trace.requests)
        assert sum(run.per_rank_prompt) == run.prompt_tokens
        assert 0 <= run.hit_rate <= 1 and run.imbalance >= 1
    assert aff.sessions_split == 0 and aff.sessions == 12
    assert rr.sessions_split > 0
    assert aff.hit_rate > rr.hit_rate
    assert aff.affinity["bound"] == 12 and aff.affinity["closed"] > 0


def test_main_writes_table_json_and_plot(tmp_path, capsys, trace, monkeypatch):
    monkeypatch.setattr(dp_scale, "_trace", lambda args: trace)
    rc = dp_scale.main(["--ranks", "2", "--pool", str(_pool(trace, 2)),
                        "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "single-rank hit rate" in out and "affinity" in out and "total_tokens" in out
    doc = json.loads((tmp_path / dp_scale.RESULTS_JSON).read_text())
    assert {r["method"] for r in doc["runs"]} == set(dp_scale.METHODS)
    assert (tmp_path / dp_scale.PLOT_PNG).stat().st_size > 0
