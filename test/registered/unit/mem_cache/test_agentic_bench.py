"""The agentic-session benchmark (``sglang_session_cache_bench.agentic``) and its
trace module: the quick run on the real patched cache, its outputs, identical
off/on request streams, session-on reuse under pressure, JSONL replay, and
line-numbered errors for bad JSONL."""

import hashlib
import json
import os
import subprocess
import sys

import pytest

from sglang_session_cache.protection_policy import AUTO_FRACTION_CEILING
from sglang_session_cache_bench import agentic
from sglang_session_cache_bench.trace import (
    GeneratorConfig,
    TraceClose,
    TraceError,
    TraceRequest,
    generate_trace,
    ideal_stats,
    read_jsonl,
    tokenize_text,
)


@pytest.fixture(scope="module", autouse=True)
def _release_server_args():
    yield
    from sglang_session_cache_bench.harness import release_server_args

    release_server_args()


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One ``--quick`` run (all three shapes, two pool sizes), shared."""
    out = tmp_path_factory.mktemp("quick")
    trace_file = out / "quick.jsonl"
    rc = agentic.main(
        ["--quick", "--out", str(out), "--check-every", "25",
         "--save-trace", str(trace_file)]
    )
    with open(out / agentic.RESULTS_JSON) as fh:
        results = json.load(fh)
    return rc, out, results, trace_file


def _runs(results):
    for shape, rows in results["shapes"].items():
        for row in rows:
            yield shape, row


# ---- the quick run ------------------------------------------------------


def test_quick_run_completes_and_writes_outputs(quick, capsys):
    rc, out, results, _ = quick
    assert rc == 0, results["issues"]
    assert results["issues"] == []
    png = out / agentic.PLOT_PNG
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000
    assert set(results["shapes"]) == set(agentic.SHAPES)
    for shape, row in _runs(results):
        assert row["off"] is not None and row["on"] is not None, (shape, row)
        assert row["off"]["session"] is False and row["on"]["session"] is True


def test_table_goes_to_stdout(tmp_path, capsys):
    rc = agentic.main(["--quick", "--shapes", "full", "--sizes", "20%",
                       "--out", str(tmp_path), "--no-plot"])
    captured = capsys.readouterr()
    assert rc == 0
    assert "== FULL ==" in captured.out
    assert "gain" in captured.out and "kept" in captured.out
    assert "[agentic]" not in captured.out  # progress is on stderr
    assert "[agentic]" in captured.err
    assert not (tmp_path / agentic.PLOT_PNG).exists()
    assert (tmp_path / agentic.RESULTS_JSON).exists()


def test_baseline_runs_side_by_side_with_the_share_of_its_gain_kept(tmp_path, capsys):
    """--baseline: a third run per cell with the protection before earned
    protection and the bound; its gain and the share the on-run keeps."""
    import json

    rc = agentic.main(["--quick", "--shapes", "full", "--sizes", "20%", "--baseline",
                       "--mode", "closed,tag-all", "--out", str(tmp_path), "--no-plot"])
    out = capsys.readouterr().out
    assert rc == 0
    doc = json.loads((tmp_path / agentic.RESULTS_JSON).read_text())
    for mode in ("closed", "tag-all"):
        (row,) = doc["modes"][mode]["shapes"]["full"]
        assert row["base"]["session"] is True
        assert row["base"]["stream_digest"] == row["off"]["stream_digest"]
        base_points = 100 * (row["base"]["hit_rate"] - row["off"]["hit_rate"])
        assert row["base_gain_points"] == pytest.approx(base_points)
        if base_points > 0:
            assert row["kept_of_base"] == pytest.approx(row["gain_points"] / base_points)
    assert "% of base" in out and "share of the baseline's gain kept" in out


def test_windows_split_each_run_into_equal_request_windows(tmp_path, capsys):
    """--windows N: the hit rate off and on in each of N windows of the
    requests (the same requests on both sides), the gain per window, and
    with several modes the worst window after the first."""
    rc = agentic.main(["--quick", "--shapes", "full", "--sizes", "12%", "--windows", "4",
                       "--mode", "closed,tag-all", "--out", str(tmp_path), "--no-plot"])
    out = capsys.readouterr().out
    assert rc == 0
    doc = json.loads((tmp_path / agentic.RESULTS_JSON).read_text())
    later = []
    for mode in ("closed", "tag-all"):
        (row,) = doc["modes"][mode]["shapes"]["full"]
        off, on = row["off"], row["on"]
        # Same request stream: the windows hold the same prompt tokens.
        assert [m[0] for m in off["window_marks"]] == [m[0] for m in on["window_marks"]]
        for r in (off, on):
            marks = r["window_marks"]
            assert len(marks) == 4 == len(r["window_hit_rates"])
            assert marks[-1] == [r["prompt_tokens"], r["reused_tokens"]]
            prompts = [p for p, _ in marks]
            assert prompts == sorted(set(prompts))  # every window holds requests
            # The windows' hit rates, weighted by their prompt tokens, are
            # the whole run's.
            sizes = [b - a for a, b in zip([0] + prompts, prompts)]
            whole = sum(h * n for h, n in zip(r["window_hit_rates"], sizes)) / prompts[-1]
            assert whole == pytest.approx(r["hit_rate"])
        gains = [(b - a) / a for a, b in zip(off["window_hit_rates"], on["window_hit_rates"])]
        assert row["window_gains"] == pytest.approx(gains)
        later.append(min(gains[1:]))
        line = " ".join(f"{100 * g:+.1f}%" for g in gains)
        assert f"; gain {line}" in out
    assert "worst (on - off) / off in any window after the first" in out
    for mode, worst in zip(("closed", "tag-all"), later):
        assert f"{mode:<14}" + f"{f'{100 * worst:+.1f}%':>30}" in out


def test_windows_never_outnumber_the_requests(tmp_path):
    """More windows than requests: one window per request."""
    from sglang_session_cache_bench.harness import session_server_args

    lines = [json.dumps({"session_id": "a", "tokens": list(range(1, 60)), "output_len": 4}),
             json.dumps({"session_id": "a", "tokens": list(range(1, 90)), "output_len": 4}),
             json.dumps({"tokens": list(range(500, 540)), "output_len": 2})]
    trace = read_jsonl(_write(tmp_path / "t.jsonl", lines))
    with session_server_args({}):
        st = agentic.replay(trace, "full", 4000, True, windows=10)
    assert len(st.window_marks) == 3
    assert [p for p, _ in st.window_marks] == [59, 59 + 89, 59 + 89 + 40]
    assert st.window_hit_rates[1] > 0  # the second turn reused the first
    assert agentic.replay(trace, "full", 4000, False).window_marks == []  # off by default


def test_protect_from_turn_flag_accepts_auto(capsys):
    args = agentic.build_parser().parse_args(["--session-radix-cache-protect-from-turn", "auto"])
    assert args.protect_from_turn == "auto"
    with pytest.raises(SystemExit):
        agentic.build_parser().parse_args(["--session-radix-cache-protect-from-turn", "0"])


def test_off_and_on_replay_the_identical_request_stream(quick):
    _, _, results, _ = quick
    trace = results["trace"]
    for shape, row in _runs(results):
        off, on = row["off"], row["on"]
        for key in ("requests", "prompt_tokens", "session_prompt_tokens",
                    "oneshot_prompt_tokens", "closes", "stream_digest"):
            assert off[key] == on[key], (shape, row["pool_tokens"], key)
        assert off["prompt_tokens"] == trace["prompt_tokens"]
        assert off["requests"] == trace["requests"]
        assert off["reused_tokens"] + off["recomputed_tokens"] == off["prompt_tokens"]


def test_session_on_reuses_at_least_as_much_under_pressure(quick):
    _, _, results, _ = quick
    for shape, rows in results["shapes"].items():
        smallest = min(rows, key=lambda r: r["pool_tokens"])
        off, on = smallest["off"], smallest["on"]
        # Pressure exists: both runs evicted, and the pool is smaller than the
        # trace's footprint.
        assert off["evicted_tokens"] > 0 and on["evicted_tokens"] > 0, shape
        assert smallest["pool_tokens"] < results["ideal"]["footprint_tokens"]
        assert on["reused_tokens"] >= off["reused_tokens"], (shape, off, on)
        assert on["session_reused_tokens"] >= off["session_reused_tokens"], shape
        assert on["kept_rate"] >= off["kept_rate"], shape
        assert smallest["gain"] == pytest.approx(
            (on["hit_rate"] - off["hit_rate"]) / off["hit_rate"])
        # Nothing can reuse more than an infinite cache.
        assert on["reused_tokens"] <= results["ideal"]["hit_tokens"]
        # What a server would export at the end of the trace: the learned
        # protection (a share of the pool up to the auto ceiling) and the
        # lifecycle counters -- the tracker saw session requests register
        # and every close of the trace.
        metrics = on["session_metrics"]
        assert 0.0 <= metrics["effective_protected_fraction"] <= AUTO_FRACTION_CEILING
        assert metrics["registered"] > 0
        assert metrics["closed"] == on["closes"]
        assert off["session_metrics"] == {}


# ---- trace generator ----------------------------------------------------


def test_generator_is_seeded_and_resends_whole_conversations():
    cfg = GeneratorConfig(sessions=10, concurrency=6, turns=6, system_prompt=64,
                          oneshot_body=(16, 64), seed=3)
    a, b = generate_trace(cfg), generate_trace(cfg)
    assert [(e.session_id, e.prompt, e.output) for e in a.requests] == \
           [(e.session_id, e.prompt, e.output) for e in b.requests]
    cfg.seed = 4
    assert [e.prompt for e in generate_trace(cfg).requests] != [e.prompt for e in a.requests]

    last: dict = {}
    system = None
    for ev in a.requests:
        if ev.session_id is None:
            continue
        if system is None:
            system = ev.prompt[:64]
        assert ev.prompt[:64] == system  # shared system prompt
        prev = last.get(ev.session_id)
        if prev is not None:
            # Previous prompt + previous output + something new.
            head = prev.prompt + prev.output
            assert ev.prompt[: len(head)] == head
            assert len(ev.prompt) > len(head)
            assert ev.turn == prev.turn + 1
        last[ev.session_id] = ev
    s = a.summary()
    assert s["sessions"] == 10
    assert 0 < s["closes"] <= 10
    share = s["oneshot_requests"] / s["requests"]
    assert abs(share - cfg.oneshot_frac) < 0.05
    ideal = ideal_stats(a)
    assert 0 < ideal["hit_tokens"] < s["prompt_tokens"]


def test_generator_rejects_bad_settings():
    with pytest.raises(ValueError):
        generate_trace(GeneratorConfig(sessions=0))
    with pytest.raises(ValueError):
        generate_trace(GeneratorConfig(oneshot_frac=1.0))


# ---- JSONL replay -------------------------------------------------------


def test_tokenizer_is_deterministic_and_prefix_stable():
    def h(piece):
        return int.from_bytes(hashlib.blake2b(piece.encode(), digest_size=4).digest(), "big")

    assert tokenize_text("run tests,  now") == [
        h("run"), h(" "), h("tests"), h(","), h("  "), h("now")]
    base = "You are a coding agent.\nTask: fix the bug."
    assert tokenize_text(base + " Tool: ok")[: len(tokenize_text(base))] == tokenize_text(base)


def test_saved_trace_replays_identically(quick, tmp_path):
    """A generated trace written with --save-trace and replayed with --trace
    gives the same request stream and the same hit rates."""
    _, _, results, trace_file = quick
    replay_trace = read_jsonl(str(trace_file))
    assert replay_trace.summary()["prompt_tokens"] == results["trace"]["prompt_tokens"]
    pool = min(r["pool_tokens"] for r in results["shapes"]["full"])
    rc = agentic.main(["--trace", str(trace_file), "--shapes", "full",
                       "--sizes", str(pool), "--out", str(tmp_path), "--no-plot"])
    assert rc == 0
    with open(tmp_path / agentic.RESULTS_JSON) as fh:
        replayed = json.load(fh)
    orig = next(r for r in results["shapes"]["full"] if r["pool_tokens"] == pool)
    again = replayed["shapes"]["full"][0]
    for key in ("off", "on"):
        assert again[key]["stream_digest"] == orig[key]["stream_digest"]
        assert again[key]["reused_tokens"] == orig[key]["reused_tokens"]


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_jsonl_text_sessions_hit_the_prefix_cache(tmp_path):
    system = "You are a careful coding agent. " * 20
    turn1 = system + "Task: make the tests pass."
    out1 = " I will run the tests first."
    # (No trailing whitespace: " " + " Let" would tokenize as one "  " run.)
    tool1 = " Tool output: 3 failed, 12 passed." * 6
    turn2 = turn1 + out1 + tool1
    out2 = " Let me open the failing file."
    turn3 = turn2 + out2 + " Tool output: file contents ... " * 8
    lines = [
        json.dumps({"session_id": "agent-1", "text": turn1, "output": out1}),
        json.dumps({"tokens": list(range(1, 200)), "output_len": 8}),
        "",
        json.dumps({"session_id": "agent-2", "text": system + "Task: docs.", "output_len": 4,
                    "close": True}),
        json.dumps({"session_id": "agent-1", "text": turn2, "output": out2}),
        json.dumps({"session_id": "agent-1", "text": turn3, "output_len": 0}),
        json.dumps({"close": "agent-1"}),
    ]
    path = _write(tmp_path / "t.jsonl", lines)
    trace = read_jsonl(path)
    kinds = [type(e).__name__ for e in trace.events]
    assert kinds == ["TraceRequest"] * 5 + ["TraceClose"]
    assert trace.events[3].line == 5 and trace.events[5].line == 7
    assert [e.turn for e in trace.requests] == [1, 0, 1, 2, 3]
    assert trace.requests[0].output == tokenize_text(out1)
    assert len(trace.requests[1].output) == 8
    assert trace.requests[2].close is True

    rc = agentic.main(["--trace", path, "--shapes", "full,swa_mamba", "--sizes", "6000",
                       "--out", str(tmp_path), "--no-plot"])
    assert rc == 0
    with open(tmp_path / agentic.RESULTS_JSON) as fh:
        results = json.load(fh)
    assert results["trace"]["requests"] == 5
    assert results["trace"]["closes"] == 2
    for shape in ("full", "swa_mamba"):
        for key in ("off", "on"):
            r = results["shapes"][shape][0][key]
            # Turns 2 and 3 of agent-1 resend the conversation: both kept.
            assert r["followups"] == 2 and r["followups_kept"] == 2, (shape, key)
            assert r["session_reused_tokens"] > len(tokenize_text(turn2))
            assert r["evicted_tokens"] == 0  # the pool holds everything
    full_on = results["shapes"]["full"][0]["on"]
    assert full_on["closes"] == 2 and full_on["session_metrics"]["closed"] == 2


GOOD = [
    json.dumps({"session_id": "a", "tokens": [1, 2, 3], "output_len": 2}),
    json.dumps({"tokens": [4, 5], "output_len": 1}),
]

BAD_LINES = [
    ("this is not json", "invalid JSON"),
    ("[1, 2, 3]", "expected a JSON object, got array"),
    ('{"session_id": "a", "output_len": 3}', "missing field 'tokens' or 'text'"),
    ('{"tokens": [1, 2]}', "missing field 'output_len'"),
    ('{"tokens": [1, 2], "output_len": -4}', "'output_len' must be >= 0, got -4"),
    ('{"tokens": [1, 2], "output_len": 2.5}', "'output_len' must be an integer"),
    ('{"tokens": [1, 2], "output_len": "3"}', "'output_len' must be an integer"),
    ('{"session_id": "", "tokens": [1], "output_len": 1}', "'session_id' is an empty string"),
    ('{"session_id": "  ", "tokens": [1], "output_len": 1}', "'session_id' is an empty string"),
    ('{"session_id": 7, "tokens": [1], "output_len": 1}',
     "'session_id' must be a non-empty string, got integer"),
    ('{"tokens": "1 2 3", "output_len": 1}', "'tokens' must be an array of integers, got string"),
    ('{"tokens": [], "output_len": 1}', "'tokens' is empty"),
    ('{"tokens": [1, -2], "output_len": 1}', "tokens[1] = -2 is outside"),
    ('{"tokens": [1, true], "output_len": 1}', "tokens[1] must be an integer, got boolean"),
    ('{"text": "", "output_len": 1}', "'text' is empty"),
    ('{"text": 5, "output_len": 1}', "'text' must be a string, got integer"),
    ('{"tokens": [1], "text": "x", "output_len": 1}', "either 'tokens' or 'text'"),
    ('{"tokens": [1], "output": [1, 2], "output_len": 3}', "'output_len' is 3 but 'output' has 2"),
    ('{"tokens": [1], "output": 5}', "'output' must be an array of integers or a string"),
    ('{"tokens": [1], "output_len": 1, "close": true}', "'close': true needs a 'session_id'"),
    ('{"session_id": "a", "tokens": [1], "output_len": 1, "close": "yes please"}',
     "takes no other fields"),
    ('{"session_id": "a", "tokens": [1], "output_len": 1, "close": 1}',
     "'close' must be a boolean"),
    ('{"close": ""}', "'close' is an empty string"),
    ('{"close": 3}', "'close' must be a non-empty string, got integer"),
    ('{"sesion_id": "a", "tokens": [1], "output_len": 1}', "unknown field(s) ['sesion_id']"),
]


@pytest.mark.parametrize("bad,message", BAD_LINES, ids=[m for _, m in BAD_LINES])
def test_bad_jsonl_line_is_named(tmp_path, capsys, bad, message):
    path = _write(tmp_path / "bad.jsonl", GOOD + [bad])
    with pytest.raises(TraceError) as exc:
        read_jsonl(path)
    assert "line 3:" in str(exc.value) and message in str(exc.value)

    rc = agentic.main(["--trace", path, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc != 0
    assert "line 3:" in err and message in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_trace_file_errors(tmp_path, capsys):
    with pytest.raises(TraceError, match="cannot open trace"):
        read_jsonl(str(tmp_path / "missing.jsonl"))
    empty = _write(tmp_path / "empty.jsonl", ["", json.dumps({"close": "a"})])
    with pytest.raises(TraceError, match="no requests"):
        read_jsonl(empty)
    blob = tmp_path / "latin1.jsonl"
    blob.write_bytes(b'{"text": "caf\xe9", "output_len": 1}\n')
    with pytest.raises(TraceError, match="not UTF-8"):
        read_jsonl(str(blob))


def test_cli_process_exits_nonzero_without_traceback(tmp_path):
    path = _write(tmp_path / "bad.jsonl", GOOD + ['{"tokens": [1], "output_len": -1}'])
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_session_cache_bench.agentic", "--trace", path],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 2
    assert "line 3:" in proc.stderr and "'output_len' must be >= 0, got -1" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        agentic.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--seed", "--sessions", "--turns", "--concurrency", "--shapes",
                 "--sizes", "--trace", "--save-trace", "--quick", "--out",
                 "--check-every", "--no-plot", "3%,5%"):
        assert flag in out, flag


def test_bad_flags_are_rejected(capsys):
    for argv in (["--sizes", "0"], ["--sizes", "abc"], ["--shapes", "mamba"],
                 ["--oneshot-frac", "1.5"], ["--sessions", "0"]):
        with pytest.raises(SystemExit) as exc:
            agentic.main(argv)
        assert exc.value.code == 2, argv


def test_event_types_exported():
    assert TraceRequest([1], [2]).output_len == 1
    assert TraceClose("a").session_id == "a"
