"""Two live CPU workers behind the real SGLang Model Gateway (PyPI ``smg``).

    python -m sglang_session_cache_bench.smg_live [--policies round_robin,cache_aware,manual]

Starts two tiny-model SGLang servers with the session cache on (the ``live``
launcher, ``live_server.LaunchedServer``), then for every policy starts
``smg launch --policy P`` in front of them (its own process group, loopback
only) and replays one small generated agentic trace through it: every session
turn is a ``/generate`` with ``session_id`` in the body and
``X-SMG-Routing-Key: <session_id>`` as header; closes go to every worker
through ``sglang_session_cache.close_fanout`` (the router has no
``/close_session`` route -- shown by the run, which posts one to the router
and prints the answer).  Between policies the workers' caches are flushed and
session ids get a new prefix.

Reported per policy: hit rate (``meta_info.cached_tokens`` / prompt tokens),
sessions whose turns reached more than one worker, requests per worker.  The
worker that served a request is the one whose own request count went up
(requests run one at a time; ``GET /v1/loads`` is not enough, so each worker
runs with ``--enable-metrics`` and the count is read from ``/metrics``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Optional

from sglang_session_cache.close_fanout import close_everywhere, router_workers
from sglang_session_cache_bench.live_server import (LaunchedServer, flush_cache, free_port,
                                                    start_all, stop_all, stop_process_groups)
from sglang_session_cache_bench.tiny_models import VOCAB_SIZE
from sglang_session_cache_bench.trace import GeneratorConfig, TraceClose, generate_trace

POLICIES = ("round_robin", "cache_aware", "manual")
ROUTING_HEADER = "X-SMG-Routing-Key"
_REQ_COUNT = re.compile(r'^sglang:num_requests_total\{[^}]*\}\s+([0-9.e+]+)', re.M)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _post(url: str, payload: dict, headers: Optional[dict] = None, timeout: float = 300):
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")


def _get(url: str, timeout: float = 30) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode("utf-8", "replace")


def small_trace(seed: int = 0, sessions: int = 8):
    """A few short agent sessions with token ids inside the tiny model's vocab."""
    return generate_trace(GeneratorConfig(
        sessions=sessions, concurrency=4, turns=4, system_prompt=96, task=(16, 48),
        model_output=(4, 8), tool_output=(16, 64), user_message=(8, 16),
        oneshot_frac=0.25, oneshot_templates=2, oneshot_template=32,
        oneshot_body=(32, 96), oneshot_output=(2, 6), vocab=VOCAB_SIZE, seed=seed))


class Router:
    """``smg launch`` in its own process group, loopback only."""

    def __init__(self, workers: list, policy: str, log_path: str):
        self.port = free_port()
        self.policy = policy
        self.log_path = log_path
        smg = os.path.join(os.path.dirname(sys.executable), "smg")
        self.cmd = [smg, "launch", "--host", "127.0.0.1", "--port", str(self.port),
                    "--policy", policy, "--worker-urls", *workers,
                    "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        if policy == "manual":
            # Pinned whatever the load: smg's default overload veto would move
            # a session off a busy worker (see session_scale_out.mdx).
            self.cmd += ["--assignment-mode", "min_load", "--disable-worker-overload-protection"]
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, n_workers: int, timeout: float = 120) -> "Router":
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited with {self.proc.returncode}; log {self.log_path}")
            try:
                doc = json.loads(_get(self.url + "/workers", timeout=5))
                healthy = [w for w in doc.get("workers", []) if w.get("is_healthy", True)]
                if len(healthy) >= n_workers:
                    return self
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"smg did not list {n_workers} healthy workers; log {self.log_path}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_groups([self.proc], timeout=10)


@dataclass
class PolicyRun:
    policy: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    per_worker: dict = field(default_factory=dict)
    session_workers: dict = field(default_factory=dict)
    close_results: list = field(default_factory=list)
    router_close_status: Optional[int] = None

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def sessions_split(self) -> int:
        return sum(1 for ws in self.session_workers.values() if len(ws) > 1)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["session_workers"] = {k: sorted(v) for k, v in self.session_workers.items()}
        d.update(hit_rate=self.hit_rate, sessions_split=self.sessions_split)
        return d


def _request_counts(workers: list) -> list:
    counts = []
    for w in workers:
        m = _REQ_COUNT.findall(_get(w + "/metrics"))
        counts.append(sum(float(x) for x in m))
    return counts


def replay(router: Router, workers: list, trace, prefix: str) -> PolicyRun:
    run = PolicyRun(router.policy)
    sid_of = lambda sid: f"{prefix}{sid}" if sid is not None else None  # noqa: E731
    before = _request_counts(workers)
    for ev in trace.events:
        if isinstance(ev, TraceClose):
            run.close_results += [r.__dict__ for r in close_everywhere(sid_of(ev.session_id),
                                                                        router_workers(router.url))]
            continue
        sid = sid_of(ev.session_id)
        body = {"input_ids": ev.prompt,
                "sampling_params": {"max_new_tokens": max(1, len(ev.output)),
                                    "temperature": 0, "ignore_eos": True}}
        headers = {}
        if sid is not None:
            body["session_id"] = sid
            headers[ROUTING_HEADER] = sid
        status, text = _post(router.url + "/generate", body, headers)
        if status != 200:
            raise RuntimeError(f"{router.policy}: /generate -> {status}: {text[:300]}")
        meta = json.loads(text)["meta_info"]
        after = _request_counts(workers)
        served = [i for i, (a, b) in enumerate(zip(after, before)) if a > b]
        before = after
        worker = served[0] if len(served) == 1 else -1
        run.requests += 1
        run.prompt_tokens += meta["prompt_tokens"]
        run.cached_tokens += meta.get("cached_tokens", 0)
        run.per_worker[worker] = run.per_worker.get(worker, 0) + 1
        if sid is not None:
            run.session_workers.setdefault(sid, set()).add(worker)
        if ev.close:
            run.close_results += [r.__dict__ for r in close_everywhere(sid, router_workers(router.url))]
    # What the router itself does with a close.
    run.router_close_status, _ = _post(router.url + "/close_session", {"session_id": f"{prefix}x"})
    return run


def format_table(runs: list) -> str:
    lines = [f"{'policy':<13} {'hit':>6} {'split':>7} {'requests per worker':<22} "
             f"{'closes ok':>10} {'router /close_session':>22}"]
    for r in runs:
        per = ", ".join(f"w{k}: {v}" for k, v in sorted(r.per_worker.items()))
        ok = sum(1 for c in r.close_results if c["ok"])
        lines.append(f"{r.policy:<13} {r.hit_rate:>6.3f} {r.sessions_split:>3}/{len(r.session_workers):<3} "
                     f"{per:<22} {ok:>4}/{len(r.close_results):<5} {r.router_close_status!s:>22}")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sglang_session_cache_bench.smg_live",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out")
    args = p.parse_args(argv)
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    trace = small_trace(args.seed, args.sessions)
    os.makedirs(args.out, exist_ok=True)
    servers = [LaunchedServer("llama", name=f"smg-worker{i}", extra_args=["--enable-metrics"])
               for i in range(2)]
    runs = []
    _log("starting 2 CPU workers ...")
    start_all(servers)
    try:
        workers = [s.url for s in servers]
        for k, policy in enumerate(policies):
            for w in workers:
                # Each policy starts from empty caches.
                status, body = flush_cache(w)
                if status != 200:
                    raise RuntimeError(f"{w}/flush_cache failed ({status}): {body.strip()}")
            router = Router(workers, policy, os.path.join(args.out, f"smg_{policy}.log"))
            _log(f"smg --policy {policy} ...")
            try:
                router.start(len(workers))
                runs.append(replay(router, workers, trace, prefix=f"p{k}-"))
            finally:
                router.stop()
        for s in servers:
            if "Traceback" in s.log_text():
                _log(f"{s.name}: Traceback in server log:\n{s.log_tail()}")
    finally:
        stop_all(servers)
    print(f"trace: {trace.summary()['requests']} requests, "
          f"{trace.summary()['sessions']} sessions; 2 tiny CPU workers (session cache on)")
    print("hit = cached_tokens / prompt tokens; split = sessions served by more than one worker")
    print(format_table(runs))
    with open(os.path.join(args.out, "smg_live_results.json"), "w", encoding="utf-8") as fh:
        json.dump([r.as_dict() for r in runs], fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
