"""Real traces in and client behaviour for the agentic benchmark: Mooncake /
aiperf import (expansion, scaling, given and inferred sessions, closes,
line-numbered errors, format detection), tagging/closing policies and modes,
trace-time replay honouring the session TTL on the real patched cache, and
the benchmark's reporting (results saved per run, interrupted runs, raised and
merged pool sizes, sessions closed, gains in points)."""

import json

import pytest

from sglang_session_cache_bench import agentic
from sglang_session_cache_bench.mooncake import detect_format, read_mooncake
from sglang_session_cache_bench.trace import (
    GeneratorConfig,
    Trace,
    TraceClose,
    TraceError,
    TraceRequest,
    generate_trace,
    ideal_stats,
    read_jsonl,
    sessions_closed,
)
from sglang_session_cache_bench.workload_modes import MODES, apply_policy, mode_ttl


@pytest.fixture(scope="module", autouse=True)
def _release_server_args():
    yield
    from sglang_session_cache_bench.harness import release_server_args

    release_server_args()


def _write(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows)
                    + "\n", encoding="utf-8")
    return str(path)


def _mc(ts, n_in, hashes, n_out=4, **extra):
    row = {"timestamp": ts, "input_length": n_in, "output_length": n_out,
           "hash_ids": hashes}
    if ts is None:
        del row["timestamp"]
    row.update(extra)
    return row


# ---- Mooncake: expansion, order, sessions -------------------------------


def test_mooncake_blocks_expand_to_shared_prefixes_and_scale(tmp_path):
    path = _write(tmp_path / "m.jsonl", [
        _mc(0, 1200, [7, 8, 9], n_out=52),
        _mc(105, 1800, [7, 3, 4, 5], n_out=26),
    ])
    t = read_mooncake(path, block_size=8)
    a, b = t.requests
    # 1200 tokens of 512-blocks = 3 blocks; scaled to 8-token blocks: 19 tokens.
    assert len(a.prompt) == 19 and len(b.prompt) == 29
    assert len(a.output) == 1 and len(b.output) == 1  # 52 * 8 / 512 rounded up
    assert a.prompt[:8] == b.prompt[:8]  # shared leading hash id 7
    assert a.prompt[8] != b.prompt[8]
    assert len(set(a.prompt)) == 19  # distinct ids inside a prompt
    full = read_mooncake(path)  # default 512: the recorded lengths
    assert [len(r.prompt) for r in full.requests] == [1200, 1800]
    assert [len(r.output) for r in full.requests] == [52, 26]
    assert [r.time for r in full.requests] == [0.0, 0.105]
    # A trace recorded with 16-token blocks.
    t16 = read_mooncake(_write(tmp_path / "b16.jsonl", [_mc(0, 40, [1, 2, 3])]),
                        block_size=4, trace_block_size=16)
    assert len(t16.requests[0].prompt) == 10


def test_mooncake_replays_in_timestamp_order_and_infers_sessions(tmp_path):
    path = _write(tmp_path / "m.jsonl", [
        _mc(0, 1200, [0, 1, 2]),           # line 1: conversation A, turn 1
        _mc(300, 2100, [0, 1, 2, 6, 7]),   # line 2: A turn 3 (later timestamp)
        _mc(200, 2000, [0, 1, 2, 6]),      # line 3: A turn 2
        _mc(100, 1800, [0, 3, 4, 5]),      # line 4: shares one block only: one-shot
        _mc(250, 900, [0, 3]),             # line 5: prefix of line 4, not an extension
        _mc(400, 1600, [0, 1, 2, 9]),      # line 6: extends A's turn 1, not its tip
    ])
    t = read_mooncake(path, block_size=4)
    assert [r.line for r in t.requests] == [1, 4, 3, 5, 2, 6]
    by_line = {r.line: r for r in t.requests}
    sid = by_line[1].session_id
    assert sid is not None and sid.startswith("conv-")
    assert [by_line[n].session_id for n in (1, 3, 2)] == [sid] * 3
    assert [by_line[n].turn for n in (1, 3, 2)] == [1, 2, 3]
    assert [by_line[n].close for n in (1, 3, 2)] == [False, False, True]
    for n in (4, 5, 6):
        assert by_line[n].session_id is None and by_line[n].is_oneshot, n
    # The next turn resends the previous turn's prompt (same block ids).
    assert by_line[3].prompt[: len(by_line[1].prompt)] == by_line[1].prompt
    s = t.summary()
    assert s["sessions"] == 1 and s["sessions_closed"] == 1
    assert s["session_requests"] == 3 and s["oneshot_requests"] == 3
    assert t.params["inferred_sessions"] == 1 and t.params["inferred_oneshots"] == 3


def test_mooncake_inference_picks_the_latest_conversation_with_that_list(tmp_path):
    path = _write(tmp_path / "m.jsonl", [
        _mc(0, 1100, [5, 6, 7]),
        _mc(10, 1100, [5, 6, 7]),        # identical list: a new conversation
        _mc(20, 1600, [5, 6, 7, 8]),     # continues the latest one (line 2)
        _mc(30, 2100, [5, 6, 7, 8, 9]),  # and again
    ])
    t = read_mooncake(path, block_size=2)
    first, second, third, fourth = t.requests
    assert first.session_id is None  # never continued: one-shot
    assert second.session_id == third.session_id == fourth.session_id is not None
    assert [second.turn, third.turn, fourth.turn] == [1, 2, 3]


def test_jsonl_with_output_len_round_trips_through_save_trace(tmp_path):
    path = _write(tmp_path / "t.jsonl", [
        {"session_id": "a", "tokens": [1, 2, 3], "output_len": 3, "time": 1.5},
        {"session_id": "a", "tokens": [1, 2, 3, 9], "output": [4, 5], "close": True},
    ])
    t = read_jsonl(path)
    from sglang_session_cache_bench.trace import write_jsonl

    write_jsonl(t, str(tmp_path / "again.jsonl"))
    u = read_jsonl(str(tmp_path / "again.jsonl"))
    assert [(e.prompt, len(e.output), e.close, e.time) for e in u.requests] == \
        [(e.prompt, len(e.output), e.close, e.time) for e in t.requests]
    assert u.requests[1].output == [4, 5]


def test_mooncake_given_sessions_cumulative_and_delta_turns(tmp_path):
    path = _write(tmp_path / "m.jsonl", [
        _mc(0, 1024, [1, 2], session_id="s1"),
        _mc(None, 600, [3, 4], session_id="s1", delay=2000),    # delta turn
        _mc(50, 1024, [1, 2], session_id="s2"),
        _mc(3000, 1536, [1, 2, 8], session_id="s2"),            # cumulative turn
        _mc(60, 512, [1], session_id="lonely"),
    ])
    t = read_mooncake(path, block_size=4)
    by = {}
    for r in t.requests:
        by.setdefault(r.session_id, []).append(r)
    s1a, s1b = by["s1"]
    assert s1b.time == pytest.approx(2.0)  # 0 ms + delay 2000 ms
    # Delta: previous prompt + previous output + the new blocks.
    assert s1b.prompt[: len(s1a.prompt)] == s1a.prompt
    assert s1b.prompt[len(s1a.prompt): len(s1a.prompt) + len(s1a.output)] == s1a.output
    assert len(s1b.prompt) == len(s1a.prompt) + len(s1a.output) + 5
    s2a, s2b = by["s2"]
    assert len(s2b.prompt) == 12 and s2b.prompt[:8] == s2a.prompt
    # Given ids are sessions even with one turn; each closes after its last turn.
    assert by["lonely"][0].close and not by["lonely"][0].is_oneshot
    assert [r.close for r in by["s1"]] == [False, True]
    assert t.summary()["sessions_closed"] == 3


MOONCAKE_BAD = [
    ("[1, 2]", "expected a JSON object, got array"),
    ("{not json", "invalid JSON"),
    ('{"timestamp": 0, "output_length": 1, "hash_ids": [1]}', "missing field 'input_length'"),
    ('{"timestamp": 0, "input_length": 10, "hash_ids": [1]}', "missing field 'output_length'"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "missing field 'hash_ids'"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}',
     "'input_length' must be >= 1, got 0"),
    ('{"timestamp": 0, "input_length": 10, "output_length": -1, "hash_ids": [1]}',
     "'output_length' must be >= 0, got -1"),
    ('{"timestamp": 0, "input_length": "10", "output_length": 1, "hash_ids": [1]}',
     "'input_length' must be an integer, got string"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": []}',
     "'hash_ids' must be a non-empty array"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, "x"]}',
     "hash_ids[1] must be an integer >= 0, got string"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-3]}',
     "hash_ids[0] must be an integer >= 0"),
    ('{"timestamp": 0, "input_length": 1500, "output_length": 1, "hash_ids": [1, 2]}',
     "'input_length' 1500 needs 3 block(s) of 512 tokens but 'hash_ids' has 2"),
    ('{"timestamp": -5, "input_length": 10, "output_length": 1, "hash_ids": [1]}',
     "'timestamp' must be >= 0"),
    ('{"timestamp": "soon", "input_length": 10, "output_length": 1, "hash_ids": [1]}',
     "'timestamp' must be a number of milliseconds"),
    ('{"input_length": 10, "output_length": 1, "hash_ids": [1]}', "missing field 'timestamp'"),
    ('{"delay": 5, "input_length": 10, "output_length": 1, "hash_ids": [1]}',
     "'delay' needs a 'session_id'"),
    ('{"session_id": "new", "delay": 5, "input_length": 10, "output_length": 1, '
     '"hash_ids": [1]}', "missing field 'timestamp'"),
    ('{"session_id": "", "timestamp": 0, "input_length": 10, "output_length": 1, '
     '"hash_ids": [1]}', "'session_id' is an empty string"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1], '
     '"messages": []}', "unknown field(s) ['messages']"),
]


@pytest.mark.parametrize("bad,message", MOONCAKE_BAD, ids=[m for _, m in MOONCAKE_BAD])
def test_bad_mooncake_line_is_named(tmp_path, capsys, bad, message):
    path = _write(tmp_path / "bad.jsonl", [_mc(0, 600, [1, 2]), _mc(5, 700, [1, 3]), bad])
    with pytest.raises(TraceError) as exc:
        read_mooncake(path)
    assert "line 3:" in str(exc.value) and message in str(exc.value)
    rc = agentic.main(["--trace", path, "--trace-format", "mooncake",
                       "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "line 3:" in err and message in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_trace_format_is_detected_from_the_first_line(tmp_path, capsys):
    mc = _write(tmp_path / "m.jsonl", ["", _mc(0, 10, [1])])
    own = _write(tmp_path / "o.jsonl", [{"tokens": [1, 2], "output_len": 1}])
    neither = _write(tmp_path / "n.jsonl", [{"prompt": "hi"}])
    both = _write(tmp_path / "b.jsonl", [{"tokens": [1], "hash_ids": [1]}])
    assert detect_format(mc) == "mooncake"
    assert detect_format(own) == "jsonl"
    for path in (neither, both):
        with pytest.raises(TraceError, match="line 1: cannot tell the trace format"):
            detect_format(path)
        assert agentic.main(["--trace", path, "--out", str(tmp_path / "x")]) == 2
        assert "--trace-format" in capsys.readouterr().err
    # --block-size is a Mooncake option.
    assert agentic.main(["--trace", own, "--block-size", "8",
                         "--out", str(tmp_path / "x")]) == 2
    assert "apply to Mooncake traces only" in capsys.readouterr().err
    # A first line that is not a JSON object is named, not guessed at.
    garbage = _write(tmp_path / "g.jsonl", ['{"timestamp": 0} trailing', _mc(5, 10, [1])])
    with pytest.raises(TraceError, match="line 1: invalid JSON"):
        detect_format(garbage)
    assert agentic.main(["--trace", garbage, "--block-size", "8",
                         "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "line 1: invalid JSON" in err and "Mooncake traces only" not in err
    scalar = _write(tmp_path / "s.jsonl", ['"x"'])
    with pytest.raises(TraceError, match="line 1: expected a JSON object, got string"):
        detect_format(scalar)


def test_a_byte_order_mark_is_skipped(tmp_path):
    mc = tmp_path / "bom.jsonl"
    mc.write_bytes(b"\xef\xbb\xbf" + (json.dumps(_mc(0, 10, [1])) + "\n").encode())
    assert detect_format(str(mc)) == "mooncake"
    assert len(read_mooncake(str(mc), block_size=4).requests) == 1
    own = tmp_path / "bom-own.jsonl"
    own.write_bytes(b"\xef\xbb\xbf" + b'{"tokens": [1, 2], "output_len": 1}\n')
    assert detect_format(str(own)) == "jsonl" and len(read_jsonl(str(own)).requests) == 1


def test_a_shared_prefix_request_does_not_merge_the_users_that_extend_it(tmp_path):
    # [1, 2] alone (say a system prompt and a task), then three requests that
    # extend it: the first continues it, the others are other users.
    path = _write(tmp_path / "m.jsonl", [
        _mc(0, 600, [1, 2]), _mc(10, 1600, [1, 2, 3, 4]),
        _mc(20, 1600, [1, 2, 5, 6]), _mc(30, 1600, [1, 2, 7, 8]),
    ])
    t = read_mooncake(path, block_size=2)
    first, second, third, fourth = t.requests
    assert first.session_id == second.session_id is not None
    assert third.session_id is None and fourth.session_id is None
    assert t.params["inferred_sessions"] == 1 and t.params["inferred_oneshots"] == 2


def test_inferred_session_names_never_take_a_given_id(tmp_path):
    path = _write(tmp_path / "m.jsonl", [
        _mc(0, 1100, [5, 6, 7]),
        _mc(10, 1600, [5, 6, 7, 8]),  # inferred conversation 0
        _mc(20, 600, [1, 2], session_id="conv-0"),  # a given id with that name
        _mc(30, 1100, [1, 2, 3], session_id="conv-0"),
    ])
    t = read_mooncake(path, block_size=2)
    inferred = {r.session_id for r in t.requests[:2]}
    assert inferred == {"conv-0-1"}
    assert [r.turn for r in t.requests] == [1, 2, 1, 2]
    assert [r.session_id for r in t.requests[2:]] == ["conv-0", "conv-0"]


def test_other_benchmarks_read_mooncake_traces(tmp_path, capsys):
    from sglang_session_cache_bench import dp_scale, live_bench

    path = _write(tmp_path / "m.jsonl", [_mc(i, 16, [i]) for i in range(130)])
    ns = dp_scale.build_parser().parse_args(["--trace", path, "--block-size", "16",
                                             "--trace-block-size", "16"])
    assert dp_scale._trace(ns).params["block_size"] == 16
    ns = live_bench.build_parser().parse_args(["--url", "http://127.0.0.1:9", "--trace", path,
                                               "--block-size", "16", "--trace-block-size", "16"])
    trace = live_bench.build_trace(ns)
    # Distinct blocks stay distinct once mapped into a tiny vocabulary (taken
    # modulo 500, blocks k and k + 125 were identical); equal ids stay equal.
    mapped = [tuple(live_bench.model_token(t, 500) for t in r.prompt) for r in trace.requests]
    assert len(set(mapped)) == 130 and all(t < 500 for p in mapped for t in p)
    assert live_bench.model_token(7, 500) == 7
    assert live_bench.model_token(10**12, 500) == live_bench.model_token(10**12, 500)
    bad = _write(tmp_path / "bad.jsonl", [_mc(0, 10, [1]), {"timestamp": 1}])
    assert live_bench.main(["--url", "http://127.0.0.1:9", "--trace", bad]) == 2
    assert "line 2:" in capsys.readouterr().err
    # The Mooncake options without a --trace file are a mistake, not ignored.
    assert live_bench.main(["--url", "http://127.0.0.1:9", "--block-size", "16"]) == 2
    assert dp_scale.main(["--block-size", "16", "--out", str(tmp_path / "dp")]) == 2
    assert agentic.main(["--block-size", "16", "--out", str(tmp_path / "ag")]) == 2
    assert capsys.readouterr().err.count("apply to a --trace file") == 3


def test_mooncake_trace_replays_on_the_real_cache(tmp_path, capsys):
    """Two inferred conversations, one-shots in between, a block size scaled
    down to 8: follow-ups keep their history, closes end the sessions."""
    rows = []
    for conv, base in (("a", 100), ("b", 200)):
        hashes = [0]  # a shared leading block (system prompt)
        for turn in range(4):
            hashes = hashes + [base + 2 * turn, base + 2 * turn + 1]
            rows.append(_mc(1000 * turn + (10 if conv == "b" else 0),
                            512 * len(hashes) - 100, hashes, n_out=64))
    rows += [_mc(500 + i, 900, [0, 900 + i]) for i in range(3)]
    path = _write(tmp_path / "m.jsonl", rows)
    out = tmp_path / "out"
    rc = agentic.main(["--trace", path, "--block-size", "8", "--shapes", "full",
                       "--sizes", "200", "--out", str(out), "--no-plot"])
    stdout = capsys.readouterr().out
    assert rc == 0
    results = json.loads((out / agentic.RESULTS_JSON).read_text())
    s = results["trace"]
    assert s["sessions"] == 2 and s["session_requests"] == 8 and s["oneshot_requests"] == 3
    assert "8 session turns in 2 sessions (2 closed) + 3 one-shot" in stdout
    on = results["shapes"]["full"][0]["on"]
    assert on["followups"] == 6 and on["followups_kept"] == 6
    assert on["sessions_closed"] == 2 and on["session_metrics"]["closed"] == 2
    # --save-trace writes it as JSONL that replays the same stream.
    saved = tmp_path / "saved.jsonl"
    rc = agentic.main(["--trace", path, "--block-size", "8", "--shapes", "full",
                       "--sizes", "200", "--out", str(tmp_path / "s1"), "--no-plot",
                       "--save-trace", str(saved)])
    assert rc == 0 and detect_format(str(saved)) == "jsonl"
    rc = agentic.main(["--trace", str(saved), "--shapes", "full", "--sizes", "200",
                       "--out", str(tmp_path / "s2"), "--no-plot"])
    assert rc == 0
    again = json.loads((tmp_path / "s2" / agentic.RESULTS_JSON).read_text())
    first = json.loads((tmp_path / "s1" / agentic.RESULTS_JSON).read_text())
    for key in ("off", "on"):
        a, b = first["shapes"]["full"][0][key], again["shapes"]["full"][0][key]
        assert a["stream_digest"] == b["stream_digest"]
        assert a["reused_tokens"] == b["reused_tokens"]
    assert again["trace"]["duration_s"] == first["trace"]["duration_s"]
    # --close never: nothing closed, the sessions stay open.
    rc = agentic.main(["--trace", path, "--block-size", "8", "--shapes", "full",
                       "--sizes", "200", "--close", "never", "--out", str(out),
                       "--no-plot"])
    assert rc == 0
    never = json.loads((out / agentic.RESULTS_JSON).read_text())
    on = never["shapes"]["full"][0]["on"]
    assert on["closes"] == 0 and on["session_metrics"]["closed"] == 0
    assert on["session_metrics"]["open_sessions"] == 2


# ---- client policies and modes ------------------------------------------


def _policy_trace():
    return Trace([
        TraceRequest([1, 2], [3], session_id="a", turn=1, time=0.0),
        TraceRequest([9, 9], [3], time=1.0),
        TraceRequest([1, 2, 3, 4], [5], session_id="a", turn=2, close=True, time=2.0),
        TraceRequest([5, 6], [7], session_id="b", turn=1, time=3.0),  # abandoned
        TraceRequest([8, 8], [3], time=4.0),
        TraceRequest([4, 4], [1], session_id="c", turn=1, time=5.0),
        TraceClose("c", time=6.0),
        TraceClose("c", time=7.0),        # a second close ends nothing
        TraceClose("ghost", time=8.0),    # nor does closing an unknown id
    ])


def test_sessions_closed_counts_sessions_not_close_events():
    t = _policy_trace()
    s = t.summary()
    assert s["closes"] == 4 and s["sessions_closed"] == 2
    assert sessions_closed([TraceRequest([1], [], session_id="x", close=True),
                            TraceRequest([1], [], session_id="x", close=True)]) == 2


def test_policies_tag_and_close():
    t = _policy_trace()
    assert apply_policy(t) is t
    never = apply_policy(t, close="never")
    assert never.summary()["sessions_closed"] == 0
    assert not any(isinstance(e, TraceClose) for e in never.events)
    last = apply_policy(t, close="last-turn")
    closed = {e.session_id for e in last.requests if e.close}
    assert closed == {"a", "b"}  # c already had a close line after its request
    assert last.summary()["sessions_closed"] == 3
    tagged = apply_policy(t, tag="all", close="never")
    oneshots = [e for e in tagged.requests if e.tagged_oneshot]
    assert len(oneshots) == 2
    assert len({e.session_id for e in oneshots}) == 2
    assert all(e.session_id.startswith("oneshot-") and not e.close and e.is_oneshot
               for e in oneshots)
    s = tagged.summary()
    assert s["oneshot_requests"] == 2 and s["tagged_oneshots"] == 2 and s["sessions"] == 3
    # The input trace is untouched.
    assert sum(1 for e in t.requests if e.session_id is None) == 2
    assert t.summary()["closes"] == 4


def test_modes_are_presets():
    assert set(MODES) >= {"closed", "never-closed", "ttl", "tag-all", "tag-all-ttl"}
    assert mode_ttl(MODES["closed"], 30.0) is None
    assert mode_ttl(MODES["tag-all-ttl"], None) == 60.0
    assert mode_ttl(MODES["ttl"], 300.0) == 300.0
    assert (MODES["tag-all-ttl"].tag, MODES["tag-all-ttl"].close) == ("all", "never")


def test_generator_clock_and_shared_documents():
    cfg = GeneratorConfig(sessions=6, concurrency=4, turns=4, system_prompt=32,
                          oneshot_body=(16, 64), seed=1)
    t = generate_trace(cfg)
    times = [e.time for e in t.events]
    assert times == sorted(times) and times[-1] > 60  # seconds of trace time
    by_sid: dict = {}
    for e in t.requests:
        if e.session_id is not None:
            by_sid.setdefault(e.session_id, []).append(e.time)
    gaps = [b - a for ts in by_sid.values() for a, b in zip(ts, ts[1:])]
    assert sum(gaps) / len(gaps) > 5  # turns are seconds apart, not instants
    base_oneshot = sum(len(e.prompt) for e in t.requests if e.session_id is None)
    docs = generate_trace(GeneratorConfig(**{**cfg.__dict__, "shared_docs": 2,
                                             "oneshot_frac": 0.6}))
    shots = [e.prompt for e in docs.requests if e.session_id is None]
    assert base_oneshot > 0 and len(shots) > 4
    # One-shots share whole documents, far beyond the 96-token app template.
    shared = max(_common_prefix(a, b) for i, a in enumerate(shots) for b in shots[i + 1:])
    assert shared >= cfg.oneshot_template + cfg.doc_tokens[0]
    assert ideal_stats(docs)["hit_tokens"] > 0
    with pytest.raises(ValueError):
        generate_trace(GeneratorConfig(shared_docs=-1))


def _common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---- trace time and the session TTL --------------------------------------


def _ttl_trace(tmp_path):
    sys_prompt = list(range(1, 200))
    rows = [
        {"session_id": "slow", "tokens": sys_prompt + [500], "output_len": 4, "time": 0},
        {"session_id": "fast", "tokens": sys_prompt + [600], "output_len": 4, "time": 1},
        {"session_id": "fast", "tokens": sys_prompt + [600, 601], "output_len": 4, "time": 20},
        {"tokens": [7] * 50, "output_len": 2},      # no time: arrives with the line before
        {"session_id": "fast", "tokens": sys_prompt + [600, 601, 602], "output_len": 4,
         "time": 40},
        {"session_id": "slow", "tokens": sys_prompt + [500, 501], "output_len": 4,
         "time": 500},
    ]
    return _write(tmp_path / "ttl.jsonl", rows)


def test_jsonl_time_field(tmp_path):
    t = read_jsonl(_ttl_trace(tmp_path))
    assert [e.time for e in t.events] == [0, 1, 20, 20, 40, 500]
    assert t.summary()["duration_s"] == 500
    bad = _write(tmp_path / "bad.jsonl", [
        {"tokens": [1], "output_len": 1, "time": 5},
        {"tokens": [1], "output_len": 1, "time": 2},
    ])
    with pytest.raises(TraceError, match="line 2: 'time' 2 is before the previous line's 5"):
        read_jsonl(bad)
    for v, msg in ((-1, "'time' must be >= 0"), ("x", "'time' must be a number")):
        with pytest.raises(TraceError, match=msg):
            read_jsonl(_write(tmp_path / "b2.jsonl", [{"tokens": [1], "output_len": 1,
                                                        "time": v}]))
    t = read_jsonl(_write(tmp_path / "c.jsonl", [{"tokens": [1], "output_len": 1, "time": 3},
                                                 {"close": "a", "time": 9}]))
    assert t.events[1].time == 9


def test_replay_runs_in_trace_time_and_honours_the_ttl(tmp_path):
    """The TTL expires a session idle for longer than the TTL *in trace time*
    (500 s of trace replayed in well under a second of wall time); a session
    that keeps coming back within the TTL is not expired."""
    trace = read_jsonl(_ttl_trace(tmp_path))
    st = agentic.replay(trace, "full", 2000, True, ttl=100.0)
    assert st.issues == []
    assert st.seconds < 100
    assert st.session_metrics["expired"] == 2  # "slow" at 100 s, then "fast" at 140 s
    assert st.session_metrics["open_sessions"] == 1  # "slow" reopened at 500 s
    # Without a TTL nothing expires; with a longer one neither.
    assert agentic.replay(trace, "full", 2000, True).session_metrics["expired"] == 0
    assert agentic.replay(trace, "full", 2000, True, ttl=1000.0).session_metrics["expired"] == 0
    # The session-off run ignores the TTL (no tracker) and replays the same stream.
    off = agentic.replay(trace, "full", 2000, False, ttl=100.0)
    assert off.stream_digest == st.stream_digest and off.session_metrics == {}


def test_ttl_flag_reaches_the_replay(tmp_path, capsys):
    path = _ttl_trace(tmp_path)
    rc = agentic.main(["--trace", path, "--shapes", "full", "--sizes", "2000",
                       "--session-radix-cache-ttl", "100", "--out", str(tmp_path / "o"),
                       "--no-plot"])
    out = capsys.readouterr().out
    assert rc == 0
    results = json.loads((tmp_path / "o" / agentic.RESULTS_JSON).read_text())
    assert results["workload"]["session_radix_cache_ttl"] == 100.0
    row = results["shapes"]["full"][0]
    assert row["on"]["session_metrics"]["expired"] == 2 and row["off"]["session_metrics"] == {}
    assert "session TTL 100 s of trace time" in out and "[2 expired]" in out
    with pytest.raises(SystemExit):
        agentic.main(["--session-radix-cache-ttl", "-3"])


# ---- reporting -----------------------------------------------------------


def test_pool_sizes_raised_and_merged_are_reported(tmp_path, capsys):
    notes: list = []
    assert agentic.resolve_sizes(["1%", 50, "10%", 1000], 10_000, 200, notes) == [200, 1000]
    assert any("1% (100 tokens) raised to 200" in n for n in notes)
    assert any("50 (50 tokens) raised to 200" in n for n in notes)
    assert any("1% and 50 are all 200 tokens" in n for n in notes)
    assert any("10% and 1,000 are all 1,000 tokens" in n for n in notes)
    rc = agentic.main(["--quick", "--shapes", "full", "--sizes", "1,2",
                       "--out", str(tmp_path), "--no-plot"])
    out = capsys.readouterr().out
    assert rc == 0
    results = json.loads((tmp_path / agentic.RESULTS_JSON).read_text())
    assert len(results["config"]["sizes"]) == 1
    assert "note: pool sizes 1 and 2 are all" in out
    # Pools labelled in tokens, gains in points next to relative ones, the
    # ms/req caveat pointing at the paired cost benchmark.
    assert "FULL pool in tokens" in out and " pt (" in out
    assert "noisy" in out and agentic.COST_BENCH in out
    row = results["shapes"]["full"][0]
    assert row["gain_points"] == pytest.approx(
        100 * (row["on"]["hit_rate"] - row["off"]["hit_rate"]))


def test_results_are_saved_after_every_run_and_survive_an_interrupt(tmp_path, capsys,
                                                                   monkeypatch):
    real_replay = agentic.replay
    calls = []

    def replay(*args, **kwargs):
        calls.append(args[1:4])
        if len(calls) == 3:
            # What was measured is already on disk when the third run starts.
            saved = json.loads((tmp_path / agentic.RESULTS_JSON).read_text())
            assert saved["complete"] is False
            assert saved["shapes"]["full"][0]["on"]["requests"] > 0
            raise KeyboardInterrupt
        return real_replay(*args, **kwargs)

    monkeypatch.setattr(agentic, "replay", replay)
    rc = agentic.main(["--quick", "--shapes", "full", "--out", str(tmp_path),
                       "--no-plot"])
    out = capsys.readouterr().out
    assert rc == 130
    saved = json.loads((tmp_path / agentic.RESULTS_JSON).read_text())
    assert saved["interrupted"] is True and saved["complete"] is False
    rows = saved["shapes"]["full"]
    assert rows[0]["off"] and rows[0]["on"] and "gain" in rows[0]
    assert "off" not in rows[1]
    assert "INTERRUPTED" in out


def test_several_modes_in_one_run(tmp_path, capsys):
    rc = agentic.main(["--quick", "--shapes", "full", "--sizes", "12%",
                       "--mode", "closed,tag-all-ttl", "--session-radix-cache-ttl", "30",
                       "--out", str(tmp_path), "--no-plot"])
    out = capsys.readouterr().out
    assert rc == 0
    doc = json.loads((tmp_path / agentic.RESULTS_JSON).read_text())
    assert doc["complete"] is True and list(doc["modes"]) == ["closed", "tag-all-ttl"]
    closed, tagged = doc["modes"]["closed"], doc["modes"]["tag-all-ttl"]
    assert closed["workload"]["session_radix_cache_ttl"] is None
    assert tagged["workload"] == {"tag": "all", "close": "never",
                                  "session_radix_cache_ttl": 30.0}
    assert tagged["trace"]["tagged_oneshots"] == tagged["trace"]["oneshot_requests"] > 0
    assert tagged["trace"]["sessions_closed"] == 0
    on = tagged["shapes"]["full"][0]["on"]
    assert on["session_metrics"]["expired"] > 0 and on["session_metrics"]["closed"] == 0
    # One-shot hit rates are reported for tagged one-shots too.
    assert on["oneshot_prompt_tokens"] == closed["shapes"]["full"][0]["on"]["oneshot_prompt_tokens"]
    assert "mode closed:" in out and "mode tag-all-ttl:" in out
    assert "modes side by side" in out
    summary = out[out.index("modes side by side"):]
    gain = closed["shapes"]["full"][0]["gain_points"]
    assert f"{gain:+.1f} .. {gain:+.1f} pt" in summary
    with pytest.raises(SystemExit):
        agentic.main(["--mode", "nope"])


def test_live_bench_reports_an_unreachable_server_in_one_line(capsys):
    from sglang_session_cache_bench import live_bench

    assert live_bench.main(["--url", "http://127.0.0.1:9", "--sessions", "2",
                            "--concurrency", "1"]) == 2
    err = capsys.readouterr().err
    assert "error: cannot reach the server" in err and "Traceback" not in err
    for bad in (["--concurrency", "0"], ["--vocab", "0"], ["--sessions", "0"], ["--pool", "-3"],
                ["--time-scale", "-1"], ["--time-scale", "inf"], ["--time-scale", "soon"]):
        with pytest.raises(SystemExit) as exc:
            live_bench.main(["--url", "http://127.0.0.1:9", *bad])
        assert exc.value.code == 2, bad


def test_live_bench_refuses_a_trace_larger_than_the_launch_pool(tmp_path, capsys):
    """With --launch, a request that cannot fit the servers' KV pool is a
    clear error before any server starts (no server is reachable here)."""
    from sglang_session_cache_bench import live_bench

    path = _write(tmp_path / "m.jsonl", [_mc(0, 64, [1, 2, 3, 4], n_out=8)])
    argv = ["--launch", "--trace", path, "--block-size", "16", "--trace-block-size", "16"]
    assert live_bench.main([*argv, "--pool", "71"]) == 2
    err = capsys.readouterr().err
    assert "needs 72 tokens" in err and "--pool 71" in err and "Traceback" not in err


def test_live_bench_paces_requests_by_trace_time(monkeypatch):
    """``--time-scale F``: a request waits until its trace time x F after the
    start (the earliest request's time is the origin); a late one goes at once."""
    from sglang_session_cache_bench import live_bench
    from sglang_session_cache_bench.trace import Trace, TraceRequest

    reqs = [TraceRequest(prompt=[1, 2], output=[3], time=t) for t in (10.0, 14.0, 30.0)]
    clock = [100.0]
    slept = []

    def sleep(s):
        slept.append(round(s, 6))
        clock[0] += s

    monkeypatch.setattr(live_bench.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(live_bench.time, "sleep", sleep)
    replay = live_bench.Replay("http://127.0.0.1:9", Trace(reqs), 500, 1, time_scale=0.5)
    replay.t0 = clock[0]
    replay._wait_for(reqs[0])  # the origin: due at once
    replay._wait_for(reqs[1])  # due 2 s after the start
    clock[0] += 12.0  # the server was slow: now 14 s after the start
    replay._wait_for(reqs[2])  # due at 10 s: already late, no sleep
    assert slept == [2.0]
    unpaced = live_bench.Replay("http://127.0.0.1:9", Trace(reqs), 500, 1)
    unpaced._wait_for(reqs[2])
    assert slept == [2.0]
