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
        ["--sessions", "3", "--repeats", "2", "--size", "30%", "--breakdown",
         "--json", str(out)]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "worst shape on/off" in text
    assert text.count("where the on run's time goes") == 3
    result = json.loads(out.read_text())
    assert [r["shape"] for r in result["rows"]] == ["full", "swa", "swa_mamba"]
    assert result["requests"] > 0 and result["pool_tokens"] > 0
    for r in result["rows"]:
        assert r["pairs"] == 2
        assert r["off_ms"] > 0 and r["on_ms"] > 0 and r["ratio"] > 0
        assert r["ratio_min"] <= r["ratio"] <= r["ratio_max"]
        # Same trace, same pool: sessions on never reuse less here.
        assert 0 <= r["off_hit_rate"] <= r["on_hit_rate"] <= 1
        b = r["breakdown"]
        assert 0 < b["hooks_total_us"] < b["on_us"]
        assert b["hooks"]["arrival stamp"]["calls"] == 1.0  # every request arrives once


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


def test_breakdown_times_every_hook_and_restores_the_classes():
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang_session_cache.session_tracker import UnifiedSessionRefTracker
    from sglang_session_cache_bench import hook_profile
    from sglang_session_cache_bench.agentic import min_pool_tokens
    from sglang_session_cache_bench.trace import GeneratorConfig, TraceClose, generate_trace

    before = (dict(UnifiedSessionRefTracker.__dict__), dict(UnifiedRadixCache.__dict__))
    trace = generate_trace(GeneratorConfig(seed=2, sessions=4, concurrency=2))
    summary = trace.summary()
    b = hook_profile.breakdown(trace, "swa", min_pool_tokens(trace))
    assert (dict(UnifiedSessionRefTracker.__dict__), dict(UnifiedRadixCache.__dict__)) == before
    hooks, sglang = b["hooks"], b["sglang"]
    assert set(hooks) == {label for label, *_ in hook_profile.HOOKS + hook_profile.NESTED}
    # Counted exactly: one arrival and one finish per request on both sides,
    # one close per close event, a registration only for session requests.
    n = summary["requests"]
    assert hooks["arrival stamp"]["calls"] == 1.0
    assert sglang["cache_finished_req"]["off"]["calls"] == 1.0
    assert sglang["cache_finished_req"]["on"]["calls"] == 1.0
    closes = sum(1 for ev in trace.events if isinstance(ev, TraceClose) or ev.close)
    assert hooks["close"]["calls"] * n == pytest.approx(closes)
    assert 0 < hooks["finish: registration"]["calls"] <= 1.0
    assert sglang["match_prefix"]["on"]["calls"] == sglang["match_prefix"]["off"]["calls"]
    assert all(r["us"] >= 0 for r in hooks.values())
    # The nested row is not added to the total.
    top = sum(hooks[label]["us"] for label, *_ in hook_profile.HOOKS)
    assert b["hooks_total_us"] == pytest.approx(top)
    text = hook_profile.format_breakdown("FULL+SWA", b)
    assert "session hooks, total" in text
    assert "eq. calls" not in text  # no control: two sides only


def test_equal_hit_run_splits_the_ratio_into_machinery_and_hits(capsys, tmp_path):
    out = tmp_path / "cost.json"
    rc = request_cost.main(["--sessions", "3", "--repeats", "1", "--size", "30%",
                            "--shapes", "full", "--equal-hit", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "control/off" in text and "what the extra hits cost SGLang itself" in text
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    # One pair: the medians are the pair's own ratios, so the split is exact.
    assert row["ratio"] == pytest.approx(row["equal_hit_ratio"] * row["hit_cost_ratio"])
    assert row["equal_hit_pool_tokens"] >= result["pool_tokens"]


def test_breakdown_times_the_equal_hit_control_as_a_third_side():
    from sglang_session_cache_bench import hook_profile
    from sglang_session_cache_bench.agentic import min_pool_tokens, replay
    from sglang_session_cache_bench.trace import GeneratorConfig, generate_trace, ideal_stats

    trace = generate_trace(GeneratorConfig(seed=1, sessions=3, concurrency=3))
    pool = min_pool_tokens(trace)
    eq = request_cost.equal_hit_pool(trace, "full", pool, replay(trace, "full", pool, True).hit_rate,
                                     ideal_stats(trace)["footprint"])
    b = hook_profile.breakdown(trace, "full", pool, eq)
    assert b["equal_hit_us"] > 0
    for label in ("match_prefix", "cache_finished_req"):
        row = b["sglang"][label]
        # The same requests through every cache: the same calls per request.
        assert row["equal_hit"]["calls"] == row["on"]["calls"] == row["off"]["calls"] > 0
        assert row["equal_hit"]["us"] > 0
    # The control runs no session hook: the hook rows stay the on run's.
    assert b["hooks"]["arrival stamp"]["calls"] == 1.0
    text = hook_profile.format_breakdown("FULL", b)
    assert "eq. calls" in text and "equal-hit pool" in text


def test_timed_methods_restores_on_error_and_keeps_inherited_lookups():
    from sglang_session_cache_bench.hook_profile import timed_methods

    class Base:
        def f(self):
            return 1

    class Child(Base):
        def g(self):
            raise KeyError("boom")

    with pytest.raises(KeyError):
        with timed_methods([("f", Child, "f"), ("g", Child, "g")]) as timers:
            assert Child().f() == 1
            timers.side = "other"
            Child().f()
            Child().g()
    # Counted per side; a call that raised still counts.
    assert timers.rows()["f"][0] == 1 and timers.rows()["g"][0] == 0
    assert timers.rows("other")["f"][0] == 1 and timers.rows("other")["g"][0] == 1
    assert "f" not in Child.__dict__  # inherited again, not pinned on Child
    assert Child.__dict__["g"].__name__ == "g" and not hasattr(Child.g, "__wrapped__")


def test_protection_options_reach_the_on_cache(capsys, tmp_path, monkeypatch):
    from sglang_session_cache.session_tracker import UnifiedSessionRefTracker

    seen = []
    configure = UnifiedSessionRefTracker.configure_protection

    def record(self, fraction, from_turn):
        seen.append((fraction, from_turn))
        return configure(self, fraction, from_turn)

    monkeypatch.setattr(UnifiedSessionRefTracker, "configure_protection", record)
    out = tmp_path / "cost.json"
    rc = request_cost.main(
        ["--sessions", "3", "--repeats", "1", "--size", "30%", "--shapes", "full",
         "--session-radix-cache-max-protected-fraction", "0.5",
         "--session-radix-cache-protect-from-turn", "2", "--json", str(out)]
    )
    assert rc == 0
    assert "max protected fraction 0.5" in capsys.readouterr().out
    assert json.loads(out.read_text())["max_protected_fraction"] == 0.5
    # Every on cache built (warm-up and timed pairs) got both options.
    assert seen and set(seen) == {(0.5, 2)}
    with pytest.raises(SystemExit) as bad:
        request_cost.main(["--session-radix-cache-max-protected-fraction", "1.5"])
    assert bad.value.code == 2
    assert "max-protected-fraction" in capsys.readouterr().err


@pytest.mark.parametrize("size", ["abc", "x%", "0%", "-5", "8%,16%"])
def test_a_bad_pool_size_is_a_usage_error(size, capsys):
    with pytest.raises(SystemExit) as exc:
        request_cost.main(["--size", size])
    assert exc.value.code == 2
    assert "--size" in capsys.readouterr().err
