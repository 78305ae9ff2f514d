"""Helpers for the live-server E2E tests: start a module's servers once, in
parallel; stop them by process group; print their logs when a test failed;
fail on any Traceback in them."""

from __future__ import annotations

import random
from typing import Dict, Iterable, List, Optional

import pytest
import requests

from sglang_session_cache_bench.live_server import (DEFAULT_STARTUP_TIMEOUT_S, LaunchedServer,
                                                      flush_cache, start_all, stop_all)

GREEDY = {"temperature": 0, "ignore_eos": True}


def module_servers(request, servers: Dict[str, LaunchedServer], allow_traceback=(),
                   startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S):
    """Start ``servers`` in parallel; the finalizer stops them, prints their logs
    if any test of the module failed, and fails on a Traceback in a log."""
    failed_before = request.session.testsfailed
    servers = dict(servers)  # the caller may add entries to the returned dict
    start_all(servers.values(), timeout=startup_timeout)

    def finish():
        stop_all(servers.values())
        problems = []
        for name, s in servers.items():
            text = s.log_text()
            if request.session.testsfailed > failed_before:
                print(f"\n===== server log {name} ({s.log_path}) =====\n{text[-20000:]}")
            if "Traceback" in text and name not in allow_traceback:
                problems.append(f"{name}: Traceback in {s.log_path}:\n{s.log_tail(60)}")
        if problems:
            pytest.fail("\n\n".join(problems))

    request.addfinalizer(finish)
    return dict(servers)


def generate(url: str, input_ids: List[int], session_id: Optional[str] = None,
             max_new_tokens: int = 4, **extra) -> dict:
    body = {"input_ids": input_ids, "sampling_params": dict(GREEDY, max_new_tokens=max_new_tokens)}
    if session_id is not None:
        body["session_id"] = session_id
    body.update(extra)
    r = requests.post(url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def close(url: str, session_id) -> requests.Response:
    return requests.post(url + "/close_session", json={"session_id": session_id}, timeout=60)


def tokens(rng: random.Random, n: int, lo: int = 10, hi: int = 500) -> List[int]:
    return [rng.randrange(lo, hi) for _ in range(n)]


def run_session(url: str, sid: str, first: List[int], turns: int, rng: random.Random,
                grow: int = 20, max_new_tokens: int = 4) -> List[dict]:
    """A multi-turn session resending the whole conversation each turn; returns
    one record per turn: prompt length, previous prompt+output, cached tokens."""
    prompt, out, records = list(first), [], []
    prev_total = 0
    for _ in range(turns):
        res = generate(url, prompt, sid, max_new_tokens=max_new_tokens)
        records.append({"prompt": len(prompt), "prev_total": prev_total,
                        "cached": res["meta_info"]["cached_tokens"]})
        out = res["output_ids"]
        prev_total = len(prompt) + len(out)
        prompt = prompt + out + tokens(rng, grow)
    return records


#: The previous turn's last output token has KV only if SGLang had already
#: prepared one more decode step for the request when it finished
#: (``kv_committed_len``, ``ScheduleBatch.prepare_for_decode``), which
#: depends on how requests were batched: concurrent sessions see it vary.
LAST_TOKEN_SLACK = 1


def reuses_previous_turn(cached: int, prev_total: int) -> bool:
    """Whether a turn's ``cached`` tokens cover the previous turn's prompt and
    output, ``prev_total`` tokens (up to that last token)."""
    return cached >= prev_total - LAST_TOKEN_SLACK


def metric_values(url: str, name: str) -> List[float]:
    text = requests.get(url + "/metrics", timeout=30).text
    return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")]


def flood(url: str, rng: random.Random, n: int, length: int, tag: Iterable[int] = ()) -> None:
    """Unrelated one-shot traffic (no session)."""
    for _ in range(n):
        generate(url, list(tag) + tokens(rng, length), max_new_tokens=2)


def flush(url: str) -> None:
    """Empty the server's cache (SGLang's /flush_cache), so a test starts from a
    pool with room instead of the module's leftovers (waiting for the
    scheduler to go idle: ``live_server.flush_cache``)."""
    status, body = flush_cache(url)
    assert status == 200, body


def session_survives(url: str, sid: str, prompt_len: int, flood_args: tuple) -> tuple:
    """Two turns of a session (a session that has returned is protected whatever
    --session-radix-cache-protect-from-turn learned), then
    unrelated one-shot traffic far larger than the pool, then the third turn.
    Returns (cached tokens of the third turn, prompt + output of the second)."""
    rng = random.Random(4)
    prompt = [9] + tokens(rng, prompt_len)
    for _ in range(2):
        out = generate(url, prompt, sid)["output_ids"]
        need = len(prompt) + len(out)
        prompt = prompt + out + tokens(rng, 10)
    flood(url, random.Random(5), *flood_args)
    nxt = generate(url, prompt, sid)
    close(url, sid)
    return nxt["meta_info"]["cached_tokens"], need


def classic_session_survives(url: str, prompt_len: int, flood_args: tuple) -> tuple:
    """``session_survives`` for a classic session: ``/open_session``, then
    requests with ``session_params`` that append to the previous request (the
    session controller prepends the conversation so far), a flood of one-shot
    traffic, one more turn, ``/close_session``.  Returns (cached tokens of the
    third turn, prompt + output of the second, the session id)."""
    r = requests.post(url + "/open_session", json={"capacity_of_str_len": 100_000}, timeout=60)
    assert r.status_code == 200, r.text
    sid = r.json()
    rng = random.Random(4)
    res = generate(url, [9] + tokens(rng, prompt_len), session_params={"id": sid})
    res = generate(url, tokens(rng, 10), session_params={"id": sid, "rid": res["meta_info"]["id"]})
    need = res["meta_info"]["prompt_tokens"] + len(res["output_ids"])
    flood(url, random.Random(5), *flood_args)
    nxt = generate(url, tokens(rng, 10), session_params={"id": sid, "rid": res["meta_info"]["id"]})
    assert close(url, sid).status_code == 200
    return nxt["meta_info"]["cached_tokens"], need, sid
