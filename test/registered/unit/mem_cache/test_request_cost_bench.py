"""The paired per-request cost benchmark runs end to end on a tiny trace (no
timing assertions here: the target lives in the benchmark's own output)."""

import json

import pytest

from sglang_session_cache_bench import request_cost


@pytest.fixture(scope="module", autouse=True)
def _release_server_args():
    yield
    from sglang_session_cache_bench.harness import release_server_args

    release_server_args()


def test_request_cost_benchmark_smoke(capsys, tmp_path):
    out = tmp_path / "cost.json"
    rc = request_cost.main(
        ["--sessions", "3", "--repeats", "2", "--size", "30%", "--json", str(out)]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "worst shape on/off" in text
    result = json.loads(out.read_text())
    assert [r["shape"] for r in result["rows"]] == ["full", "swa", "swa_mamba"]
    assert result["requests"] > 0 and result["pool_tokens"] > 0
    for r in result["rows"]:
        assert r["pairs"] == 2
        assert r["off_ms"] > 0 and r["on_ms"] > 0 and r["ratio"] > 0
        assert r["ratio_min"] <= r["ratio"] <= r["ratio_max"]
        # Same trace, same pool: sessions on never reuse less here.
        assert 0 <= r["off_hit_rate"] <= r["on_hit_rate"] <= 1


def test_lockstep_replays_the_same_stream_on_both_sides():
    from sglang_session_cache_bench.agentic import min_pool_tokens
    from sglang_session_cache_bench.trace import GeneratorConfig, generate_trace

    trace = generate_trace(GeneratorConfig(seed=1, sessions=3, concurrency=3))
    runs = request_cost.lockstep(trace, "full", min_pool_tokens(trace) * 2, first_on=True)
    off, on = runs[False], runs[True]
    assert off.stream_digest == on.stream_digest
    assert off.requests == on.requests == trace.summary()["requests"]
    assert not off.issues and not on.issues
    assert 0 < off.event_seconds and 0 < on.event_seconds
    assert off.request_seconds <= off.event_seconds


def test_equal_hit_control_replays_a_third_cache_that_reuses_as_much():
    from sglang_session_cache_bench.agentic import min_pool_tokens, replay
    from sglang_session_cache_bench.trace import GeneratorConfig, generate_trace, ideal_stats

    trace = generate_trace(GeneratorConfig(seed=1, sessions=3, concurrency=3))
    pool = min_pool_tokens(trace)
    footprint = ideal_stats(trace)["footprint"]
    on_hit = replay(trace, "full", pool, True).hit_rate
    eq = request_cost.equal_hit_pool(trace, "full", pool, on_hit, footprint)
    assert pool <= eq <= footprint
    runs = request_cost.lockstep(trace, "full", pool, first_on=False, equal_hit_pool=eq)
    assert set(runs) == {False, True, request_cost.EQUAL_HIT}
    control = runs[request_cost.EQUAL_HIT]
    assert not control.session and control.pool_tokens == eq
    # The control buys the on run's reuse with memory instead of sessions.
    assert control.hit_rate >= on_hit or eq == footprint
    assert control.stream_digest == runs[True].stream_digest
