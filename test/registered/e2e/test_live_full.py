"""E2E on live CPU servers, FULL-only tree (tiny Llama): the contract users run.

Servers (started once, in parallel): ``on`` = unified tree + the flag +
``--session-radix-cache-ttl`` + ``--enable-metrics``; ``off`` = unified tree,
flag off (stock SGLang); both with ``--enable-streaming-session``; ``no_unified`` = the flag without
SGLANG_ENABLE_UNIFIED_RADIX_TREE, which must fail at start-up.
"""

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from live_utils import (classic_session_survives, close, flush, generate, metric_values,
                        module_servers, reuses_previous_turn, run_session, session_survives,
                        tokens)
from sglang_session_cache_bench.live_server import LaunchedServer

POOL = 1024
TTL_S = 20
SESSION_PROMPT = 300
FLOOD = (8, 300)  # 8 one-shots of 300 tokens: 2.3x the pool


@pytest.fixture(scope="module")
def servers(request):
    no_unified = LaunchedServer("llama", session_cache=True, unified=False,
                                max_total_tokens=POOL, name="llama-no-unified").start()
    srv = module_servers(request, {
        "on": LaunchedServer("llama", session_cache=True, max_total_tokens=POOL, name="llama-on",
                             extra_args=["--enable-metrics", "--session-radix-cache-ttl", str(TTL_S),
                                         "--enable-streaming-session"]),
        "off": LaunchedServer("llama", session_cache=False, max_total_tokens=POOL, name="llama-off",
                              extra_args=["--enable-streaming-session"]),
    })
    request.addfinalizer(no_unified.stop)
    srv["no_unified"] = no_unified
    return srv


def test_patch_active_in_scheduler_process(servers):
    log = servers["on"].log_text()
    assert "Session radix cache enabled on the unified tree (components full)" in log
    assert "impl=UnifiedRadixCache" in log
    # SGLang's plugin loader activated us; the line comes through SGLang's logger.
    assert "active (SGLang plugin sglang_session_cache)" in log
    assert "Session radix cache enabled" not in servers["off"].log_text()


def test_flag_without_unified_tree_fails_at_startup(servers):
    srv = servers["no_unified"]
    status = srv.wait_exit(timeout=240)
    log = srv.log_text()
    assert status not in (None, 0), log[-3000:]
    assert "--enable-session-radix-cache needs the unified radix tree" in log
    assert "SGLANG_ENABLE_UNIFIED_RADIX_TREE=1" in log
    assert "Load weight" not in log  # failed in ServerArgs, before any process spawned


def test_multi_turn_session_reuses_previous_prompt_and_output(servers):
    url = servers["on"].url
    flush(url)  # room for the whole conversation: the module's leftovers are not its test
    recs = run_session(url, "multi", [3] + tokens(random.Random(1), 150), turns=4, rng=random.Random(2))
    assert recs[0]["cached"] < 10
    for r in recs[1:]:
        assert reuses_previous_turn(r["cached"], r["prev_total"]), recs
    assert close(url, "multi").status_code == 200


def test_concurrent_sessions(servers):
    url = servers["on"].url
    flush(url)

    def one(i):
        return run_session(url, f"conc-{i}", [20 + i] + tokens(random.Random(10 + i), 80),
                           turns=3, rng=random.Random(20 + i))

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(4)))
    for recs in results:
        for r in recs[1:]:
            assert reuses_previous_turn(r["cached"], r["prev_total"]), results
    for i in range(4):
        assert close(url, f"conc-{i}").status_code == 200


def test_kv_reusable_after_close(servers):
    url = servers["on"].url
    prompt = [5] + tokens(random.Random(3), 120)
    first = generate(url, prompt, "closing")
    assert close(url, "closing").status_code == 200
    again = generate(url, prompt + first["output_ids"] + [11, 12], "closing")
    assert reuses_previous_turn(again["meta_info"]["cached_tokens"],
                                len(prompt) + len(first["output_ids"]))
    assert close(url, "closing").status_code == 200


def test_open_session_prefix_survives_pressure_only_with_the_flag(servers):
    cached_on, need = session_survives(servers["on"].url, "keeper", SESSION_PROMPT, FLOOD)
    cached_off, _ = session_survives(servers["off"].url, "keeper", SESSION_PROMPT, FLOOD)
    print(f"FULL pool={POOL}: cached on={cached_on} off={cached_off} of {need}")
    assert cached_on >= need
    assert cached_off < need // 2


def test_classic_session_prefix_survives_pressure_only_with_the_flag(servers):
    # /open_session + session_params (SGLang's session controller), no top-level
    # session_id: the session's references are registered all the same.
    cached_on, need, sid = classic_session_survives(servers["on"].url, SESSION_PROMPT, FLOOD)
    cached_off, _, _ = classic_session_survives(servers["off"].url, SESSION_PROMPT, FLOOD)
    print(f"FULL pool={POOL}, classic session: cached on={cached_on} off={cached_off} of {need}")
    assert cached_on >= need
    assert cached_off < need // 2
    # Closed: SGLang refuses the id with a 400, and the server keeps serving.
    url = servers["on"].url
    r = requests.post(url + "/generate", json={"input_ids": [1, 2, 3], "session_params": {"id": sid},
                                               "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 400 and "does not exist" in r.text
    assert close(url, sid).status_code == 200  # closing again is harmless
    generate(url, [1, 2, 3])


def streaming_turns(url: str) -> list:
    """A streaming session (SGLang's own KV path): three appended turns, then
    close; returns (prompt tokens, cached tokens) per turn."""
    r = requests.post(url + "/open_session",
                      json={"capacity_of_str_len": 100_000, "streaming": True}, timeout=60)
    assert r.status_code == 200, r.text
    sid = r.json()
    rng = random.Random(6)
    seen = []
    for t in range(3):
        res = generate(url, ([9] + tokens(rng, 50)) if t == 0 else tokens(rng, 10),
                       session_params={"id": sid})
        seen.append((res["meta_info"]["prompt_tokens"], res["meta_info"]["cached_tokens"]))
    assert close(url, sid).status_code == 200
    return seen


def test_streaming_sessions_are_left_to_sglang(servers):
    # Streaming sessions own their KV through SGLang's streaming path; the flag
    # stays out of their way: the same turns reuse exactly what they reuse
    # without it.
    flush(servers["on"].url)
    flush(servers["off"].url)
    on, off = streaming_turns(servers["on"].url), streaming_turns(servers["off"].url)
    assert on == off, (on, off)
    assert all(cached >= prompt - 12 for prompt, cached in on[1:]), on
    generate(servers["on"].url, [1, 2, 3])  # still serving


BAD_IDS = {
    "empty": ("", "empty string"),
    "whitespace": ("   ", "only whitespace"),
    "non_string": (42, "got int"),
    "over_long": ("x" * 100_000, "100000 characters"),
    "nul": ("a\x00b", "control character"),
    "newline": ("a\nb", "control character"),
    # JSON "\ud801": the reply to /open_session once failed with a 500 after
    # the scheduler had opened the session.
    "surrogate": ("a\ud801", "unpaired surrogate"),
}


@pytest.mark.parametrize("kind", sorted(BAD_IDS))
def test_bad_session_ids_get_400_and_server_keeps_serving(servers, kind):
    url = servers["on"].url
    bad, why = BAD_IDS[kind]
    sp = {"temperature": 0, "max_new_tokens": 2}
    calls = {
        "generate": ("/generate", {"input_ids": [1, 2, 3], "session_id": bad, "sampling_params": sp}),
        "session_params": ("/generate", {"input_ids": [1, 2, 3], "session_params": {"id": bad},
                                         "sampling_params": sp}),
        "open": ("/open_session", {"capacity_of_str_len": 100, "session_id": bad}),
        "close": ("/close_session", {"session_id": bad}),
    }
    for what, (path, body) in calls.items():
        r = requests.post(url + path, json=body, timeout=60)
        assert r.status_code == 400, (what, r.status_code, r.text[:300])
        if kind == "non_string" and what != "session_params":
            # Typed str fields: SGLang's own request validation answers 400 first.
            assert "Input should be a valid string" in r.text, (what, r.text[:300])
        else:
            assert "must be a non-empty string of at most 256" in r.text, (what, r.text[:300])
            assert why in r.text, (what, r.text[:300])
        assert len(r.text) < 2000  # the 100k id is not echoed back
    assert requests.get(url + "/health", timeout=30).status_code == 200
    assert generate(url, [1, 2, 3], f"fine-{kind}")["meta_info"]["completion_tokens"] == 4
    assert close(url, f"fine-{kind}").status_code == 200


def test_bad_session_id_on_a_stream_gets_an_error_event_and_no_traceback(servers):
    # A streaming /generate answers with an SSE error event; SGLang's abort
    # task for the stream runs two seconds later and must find a request it
    # can read (a refused stream once left a Traceback in the log each time).
    url = servers["on"].url
    sp = {"temperature": 0, "max_new_tokens": 2}
    for body in ({"input_ids": [1, 2, 3]}, {"text": ["a", "b"]}):
        r = requests.post(url + "/generate", json={**body, "session_id": "", "stream": True,
                                                   "sampling_params": sp}, timeout=60)
        assert r.status_code == 200, r.text[:300]  # SSE: the error travels as an event
        events = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]", events
        assert '"code":400' in events[0].replace(" ", "") and "empty string" in events[0], events
    time.sleep(3)
    assert "Traceback" not in servers["on"].log_text()
    assert generate(url, [1, 2, 3], "after-stream")["meta_info"]["completion_tokens"] == 4
    assert close(url, "after-stream").status_code == 200


def test_flag_off_leaves_session_ids_to_stock_sglang(servers):
    # Without the flag nothing of ours checks ids: the reply is stock's.
    url = servers["off"].url
    r = requests.post(url + "/generate", json={"input_ids": [1, 2, 3], "session_id": "a\x00b",
                                               "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert "must be a non-empty string of at most 256" not in r.text, r.text[:300]
    assert requests.get(url + "/health", timeout=30).status_code == 200


def test_unknown_and_double_close_are_harmless(servers):
    url = servers["on"].url
    assert close(url, "never-opened").status_code == 200
    generate(url, [4, 5, 6], "twice")
    assert close(url, "twice").status_code == 200
    assert close(url, "twice").status_code == 200
    assert requests.get(url + "/health", timeout=30).status_code == 200


def test_a_request_finishing_after_its_close_registers_nothing(servers):
    # Closed while its request runs: the finish registers no reference (the
    # close dropped them; a late one would re-protect a closed session), and
    # the client gets its full answer.
    url = servers["on"].url
    name = "sglang:session_radix_late_finish_skipped_total"
    before = max(metric_values(url, name) or [0.0])
    body = {"input_ids": [6] + tokens(random.Random(5), 30), "session_id": "late", "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 300, "ignore_eos": True}}
    with requests.post(url + "/generate", json=body, stream=True, timeout=300) as r:
        events = (line for line in r.iter_lines() if line.startswith(b"data: "))
        next(events)  # a token streamed: the request is in flight
        assert close(url, "late").status_code == 200
        rest = list(events)
    assert rest[-1] == b"data: [DONE]" and b'"error"' not in b"".join(rest)
    generate(url, [8, 8, 8, 8])  # its prefill publishes the session metrics
    assert max(metric_values(url, name)) == before + 1
    assert close(url, "late").status_code == 200  # and closing again is harmless


def test_live_bench_replays_a_trace_against_the_server(servers, tmp_path, capsys):
    from sglang_session_cache_bench.live_bench import main

    out = tmp_path / "live.json"
    assert main(["--url", servers["on"].url, "--sessions", "2", "--concurrency", "2",
                 "--out", str(out)]) == 0
    import json

    row = json.loads(out.read_text())["rows"][0]
    assert row["session"] == "on" and row["shape"] == "FULL"
    res = row["result"]
    assert res["requests"] > 0 and not res["errors"]
    assert res["session_hit"] > 0 and res["ttft"]["1"]["p50"] > 0
    printed = capsys.readouterr().out
    assert "t2 p50/p95" in printed and "paced at trace time x 0.05" in printed
    # Paced by the trace's clock (default x 0.05): the last request cannot go
    # before its trace time x 0.05 after the start.
    from sglang_session_cache_bench import live_bench

    ns = live_bench.build_parser().parse_args(["--url", "x", "--sessions", "2", "--concurrency", "2"])
    times = [r.time for r in live_bench.build_trace(ns).requests]
    assert res["wall_s"] >= (max(times) - min(times)) * 0.05
    # Unpaced, on request: every request as soon as it can.
    assert main(["--url", servers["on"].url, "--sessions", "2", "--concurrency", "2",
                 "--time-scale", "0", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["rows"][0]["result"]
    assert not res["errors"] and res["requests"] > 0
    assert "paced" not in capsys.readouterr().out


def test_ttl_from_cli_and_metrics(servers):
    url = servers["on"].url
    # A session left idle, then an arrival past the TTL: the shared clock moves
    # with arrivals, so that arrival expires it.
    generate(url, [7] + tokens(random.Random(99), 40), "ttl-probe")
    time.sleep(TTL_S + 1)
    generate(url, [8, 8, 8])  # any arrival ticks the TTL; its stats publish the metrics
    log = servers["on"].log_text()
    assert "session: open=" in log
    assert "expired" in log and "idle session" in log
    for name in ("sglang:session_radix_open_sessions", "sglang:session_radix_referenced_tokens",
                 "sglang:session_radix_sessions_closed_total"):
        assert metric_values(url, name), name
    assert max(metric_values(url, "sglang:session_radix_sessions_expired_total")) >= 1
