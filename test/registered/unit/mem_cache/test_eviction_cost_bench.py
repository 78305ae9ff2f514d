"""The per-eviction cost benchmark runs end to end on tiny trees (no timing
assertions here: the targets live in the benchmark's own output)."""

import pytest

from sglang_session_cache_bench import eviction_cost


def test_eviction_cost_benchmark_smoke(capsys, tmp_path):
    out = tmp_path / "rows.json"
    assert eviction_cost.main(["--nodes", "300", "--rounds", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "worst cell on/off" in text
    assert "worst cell per evict() call" in text
    rows = __import__("json").loads(out.read_text())
    assert {(r["component"], r["referenced_fraction"]) for r in rows} == {
        (c, f) for c in ("full", "swa", "mamba") for f in (0.0, 0.5, 1.0)
    }
    for r in rows:
        assert r["off_us"] > 0 and r["on_us"] > 0 and r["pairs"] > 0
        assert r["total_ratio"] > 0
        if r["component"] == "full":
            assert "call_ratio" not in r  # the FULL cell is the whole call already
        else:
            assert r["call_pairs"] > 0 and r["call_off_us"] > 0 and r["call_ratio"] > 0
        if r["referenced_fraction"] == 0.0:
            assert r["referenced_leaves"] == 0
    for comp in ("full", "swa", "mamba"):
        cells = {r["referenced_fraction"]: r for r in rows if r["component"] == comp}
        # 0 % and 100 % share a pair of trees: the 100 % cell references what
        # the 0 % cell's evictions left (untimed warm-up, then timed: 10 % of
        # the leaves each at most).
        zero = cells[0.0]
        assert zero["warmup"] == 30
        # SWA / Mamba also evicted call_pairs leaves through whole evict() calls.
        spent = zero["warmup"] + zero["pairs"] + zero.get("call_pairs", 0)
        assert cells[1.0]["referenced_leaves"] == 300 - spent
        assert 0 < cells[0.5]["referenced_leaves"] < 300


def test_bad_options_are_usage_errors(capsys):
    for bad in (["--nodes", "abc"], ["--nodes", "-1"], ["--nodes", "0"], ["--nodes", ","],
                ["--components", "bogus"], ["--rounds", "0"], ["--warmup", "-1"]):
        with pytest.raises(SystemExit) as exc:
            eviction_cost.main(bad)
        assert exc.value.code == 2, bad
        err = capsys.readouterr().err
        assert "error:" in err and "Traceback" not in err, bad
