"""Session affinity at scale: N data-parallel ranks = N real caches.

    python -m sglang_session_cache_bench.dp_scale [--quick] [--ranks 2,4,8] [--pool 24%]

With ``--dp-size N`` every rank has its own radix cache; where a request lands
decides what it can reuse.  This benchmark replays one trace (the agentic
benchmark's generator, or ``--trace``) through N real, patched
``UnifiedRadixCache`` instances (the CPU harness, session cache on in every
rank) that share the TOTAL pool (``--pool`` tokens, split evenly), and routes
every request like ``DataParallelController`` would:

round_robin
    SGLang's default: rank ``i mod N``.
total_tokens
    SGLang's load-aware method: the rank with the fewest in-flight tokens
    (ties: fewest in-flight requests, then the lowest rank).
affinity
    ``SessionAffinity`` -- the very object the patched controller uses:
    a session's first turn binds to the least-loaded rank, later turns follow
    the binding unless the overload guard moves them; session-less requests
    use round_robin (the controller's default method).

Load signal: the controller reads each rank's tokens in flight (running +
waiting).  The replay runs one request at a time, so "in flight" is modelled
as the last ``--inflight`` dispatched requests (prompt + output tokens each).
The busy floor of the overload guard is half a rank's pool, as in the
controller.  A close goes to every rank (the controller broadcasts it) and
ends the session's binding.

Reported per N and method: hit rate (reused / prompt tokens, as in the
agentic benchmark), its ratio to the single-rank hit rate at the same total
pool, load imbalance = max / mean over ranks of the prompt tokens dispatched
(and of the prefill tokens computed), and the affinity counters.  Target:
affinity >= 0.95x the single-rank hit rate with imbalance <= 1.25x.

Outputs: a table on stdout, ``dp_scale_results.json`` and ``dp_scale.png``
in ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

from sglang_session_cache.dp_affinity import DEFAULT_OVERLOAD_FACTOR, SessionAffinity
from sglang_session_cache_bench import agentic
from sglang_session_cache_bench.trace_files import add_trace_format_options, trace_from_args
from sglang_session_cache_bench.trace import Trace, TraceClose, TraceError, ideal_stats
from sglang_session_cache_bench.trace_clock import TraceClock, attach

METHODS = ("round_robin", "total_tokens", "affinity")
DEFAULT_RANKS = (2, 4, 8)
DEFAULT_POOL = "24%"
DEFAULT_INFLIGHT = 16
BUSY_SHARE = 0.5  # as the controller: the guard acts on a rank over half full
TARGET_HIT_RATIO = 0.95
TARGET_IMBALANCE = 1.25
RESULTS_JSON = "dp_scale_results.json"
PLOT_PNG = "dp_scale.png"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# Routing
# --------------------------------------------------------------------------


class Router:
    """One of ``METHODS`` over ``n`` ranks with an in-flight load model."""

    def __init__(self, method: str, n: int, inflight: int, busy_floor: float,
                 overload_factor: float = DEFAULT_OVERLOAD_FACTOR):
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}")
        self.method = method
        self.n = n
        self.ranks = list(range(n))
        self.tokens = [0] * n  # in-flight tokens per rank
        self.requests = [0] * n
        self._window: collections.deque = collections.deque()
        self._inflight = inflight
        self._rr = 0
        self.affinity = SessionAffinity(overload_factor=overload_factor,
                                        min_load=busy_floor)

    def route(self, session_id: Optional[str], prompt: int, size: int, now: float) -> int:
        if self.method == "affinity" and session_id is not None:
            rank = self.affinity.route(session_id, self.ranks, self.tokens, now, cost=prompt)
        elif self.method == "total_tokens":
            rank = min(self.ranks, key=lambda r: (self.tokens[r], self.requests[r], r))
        else:
            rank = self._rr
            self._rr = (self._rr + 1) % self.n
        self._window.append((rank, size))
        self.tokens[rank] += size
        self.requests[rank] += 1
        if len(self._window) > self._inflight:
            old, old_size = self._window.popleft()
            self.tokens[old] -= old_size
            self.requests[old] -= 1
        return rank

    def close(self, session_id: str) -> None:
        if self.method == "affinity":
            self.affinity.close(session_id)


# --------------------------------------------------------------------------
# Replay
# --------------------------------------------------------------------------


@dataclass
class DPRun:
    method: str
    ranks: int
    pool_tokens: int  # total over ranks
    prompt_tokens: int = 0
    reused_tokens: int = 0
    per_rank_prompt: list = field(default_factory=list)
    per_rank_computed: list = field(default_factory=list)
    affinity: dict = field(default_factory=dict)
    sessions: int = 0  # distinct session ids seen
    sessions_split: int = 0  # sessions whose turns ran on more than one rank
    issues: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @staticmethod
    def _imbalance(values: list) -> float:
        mean = sum(values) / len(values) if values else 0
        return max(values) / mean if mean else 0.0

    @property
    def imbalance(self) -> float:
        return self._imbalance(self.per_rank_prompt)

    @property
    def computed_imbalance(self) -> float:
        return self._imbalance(self.per_rank_computed)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(hit_rate=self.hit_rate, imbalance=self.imbalance,
                 computed_imbalance=self.computed_imbalance)
        return d


def replay_dp(trace: Trace, shape: str, pool_tokens: int, ranks: int, method: str,
              inflight: int = DEFAULT_INFLIGHT,
              overload_factor: float = DEFAULT_OVERLOAD_FACTOR) -> DPRun:
    """Replay ``trace`` over ``ranks`` real caches sharing ``pool_tokens``."""
    summary = trace.summary()
    per_rank = pool_tokens // ranks
    harnesses = [agentic.make_harness(shape, per_rank, True,
                                      max_context_len=summary["max_request_tokens"] + 8)
                 for _ in range(ranks)]
    clock = TraceClock()
    for h in harnesses:
        attach(h.cache, clock, None)
    router = Router(method, ranks, inflight, BUSY_SHARE * per_rank, overload_factor)
    run = DPRun(method=method, ranks=ranks, pool_tokens=per_rank * ranks,
                per_rank_prompt=[0] * ranks, per_rank_computed=[0] * ranks)
    ranks_of: dict = {}
    t0 = time.perf_counter()
    quiet = _QuietUnknownClose()
    logging.getLogger(_TRACKER_LOGGER).addFilter(quiet)
    try:
        _replay_events(trace, harnesses, router, clock, run, ranks_of)
    finally:
        logging.getLogger(_TRACKER_LOGGER).removeFilter(quiet)
    run.seconds = time.perf_counter() - t0
    run.sessions = len(ranks_of)
    run.sessions_split = sum(1 for r in ranks_of.values() if len(r) > 1)
    for i, h in enumerate(harnesses):
        try:
            h.check()
            h.cache.validate_session_state()
        except Exception as exc:  # reported, not hidden
            run.issues.append(f"rank {i}: {type(exc).__name__}: {exc}")
    run.affinity = router.affinity.counters.as_dict() if method == "affinity" else {}
    return run


# The cache logs a warning for a close of a session it never saw; the
# controller broadcasts closes, so every rank but one would log it.
_TRACKER_LOGGER = "sglang.srt.mem_cache.unified_radix_cache"


class _QuietUnknownClose(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("close_session for unknown session")


def _replay_events(trace, harnesses, router, clock, run: DPRun, ranks_of: dict) -> None:
    for ev in trace.events:
        clock.advance(ev.time)
        if isinstance(ev, TraceClose):
            _close_everywhere(harnesses, router, ev.session_id)
            continue
        sid = ev.session_id
        n = len(ev.prompt)
        rank = router.route(sid, n, n + len(ev.output), clock.now)
        h = harnesses[rank]
        req = h.new_req(ev.prompt, session_id=sid, output_ids=ev.output)
        h.cache.ensure_session_generation(req)
        n_out = len(ev.output)
        matched = h.prefill(req, finishing=n_out <= 1)
        if n_out > 1:
            h.decode(req, n_out - 1)
        h.finish(req)
        if ev.close:
            _close_everywhere(harnesses, router, sid)
        run.prompt_tokens += n
        run.reused_tokens += matched
        run.per_rank_prompt[rank] += n
        run.per_rank_computed[rank] += n - matched
        if sid is not None:
            ranks_of.setdefault(sid, set()).add(rank)


def _close_everywhere(harnesses, router: Router, session_id: str) -> None:
    # The controller broadcasts /close_session to every rank.
    for h in harnesses:
        h.cache.release_radix_session(session_id)
    router.close(session_id)


# --------------------------------------------------------------------------
# Sweep, table, plot
# --------------------------------------------------------------------------


def run(trace: Trace, shape: str, pool_tokens: int, ranks: list, methods: list,
        inflight: int, overload_factor: float) -> dict:
    import torch

    from sglang_session_cache_bench.harness import release_server_args

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see agentic.run_benchmark
    try:
        _log(f"single rank, pool {pool_tokens:,} ...")
        single = agentic.replay(trace, shape, pool_tokens, True)
        results = {
            "trace": trace.summary(), "shape": shape, "pool_tokens": pool_tokens,
            "inflight": inflight, "overload_factor": overload_factor,
            "single_rank": {"hit_rate": single.hit_rate, "issues": single.issues},
            "runs": [],
        }
        for n in ranks:
            for method in methods:
                _log(f"N={n} {method} ...")
                r = replay_dp(trace, shape, pool_tokens, n, method, inflight, overload_factor)
                d = r.as_dict()
                d["hit_ratio"] = r.hit_rate / single.hit_rate if single.hit_rate else 0.0
                results["runs"].append(d)
        return results
    finally:
        torch.set_num_threads(threads)
        release_server_args()


def format_table(results: dict) -> str:
    single = results["single_rank"]["hit_rate"]
    lines = [
        f"{results['shape'].upper()} cache, total pool {results['pool_tokens']:,} tokens "
        f"(split evenly over N ranks); single-rank hit rate {single:.3f}",
        "hit = reused / prompt tokens; x1 = hit / single-rank hit; "
        "imb = max/mean prompt tokens per rank; imb(pf) = max/mean prefill tokens per rank;\n"
        "split = sessions whose turns ran on more than one rank; rebinds = overload-guard moves",
        "",
        f"{'N':>3} {'method':<13} {'hit':>6} {'x1':>6} {'imb':>6} {'imb(pf)':>8} "
        f"{'split':>9} {'rebinds':>8} {'target':>7}",
    ]
    for d in results["runs"]:
        rebinds = ""
        target = ""
        if d["method"] == "affinity":
            a = d["affinity"]
            rebinds = str(a["rebound_overload"] + a["rebound_inactive"])
            ok = d["hit_ratio"] >= TARGET_HIT_RATIO and d["imbalance"] <= TARGET_IMBALANCE
            target = "met" if ok else "MISSED"
        lines.append(
            f"{d['ranks']:>3} {d['method']:<13} {d['hit_rate']:>6.3f} {d['hit_ratio']:>6.3f} "
            f"{d['imbalance']:>6.3f} {d['computed_imbalance']:>8.3f} "
            f"{d['sessions_split']:>4}/{d['sessions']:<4} {rebinds:>8} {target:>7}")
    issues = [f"N={d['ranks']} {d['method']}: {i}" for d in results["runs"] for i in d["issues"]]
    issues += results["single_rank"]["issues"]
    lines.append("")
    lines.append("issues: " + ("; ".join(issues) if issues else "none (slot conservation "
                                                            "and session state checked on every rank)"))
    return "\n".join(lines)


def write_plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    single = results["single_rank"]["hit_rate"]
    for method in METHODS:
        rows = [d for d in results["runs"] if d["method"] == method]
        if not rows:
            continue
        xs = [d["ranks"] for d in rows]
        ax1.plot(xs, [d["hit_rate"] for d in rows], marker="o", label=method)
        ax2.plot(xs, [d["imbalance"] for d in rows], marker="o", label=method)
    ax1.axhline(single, color="k", linestyle="--", linewidth=1, label="single rank")
    ax1.axhline(TARGET_HIT_RATIO * single, color="grey", linestyle=":", linewidth=1,
                label=f"{TARGET_HIT_RATIO}x single rank")
    ax2.axhline(TARGET_IMBALANCE, color="grey", linestyle=":", linewidth=1,
                label=f"target {TARGET_IMBALANCE}")
    ax1.set(xlabel="DP ranks (same total pool)", ylabel="hit rate", title="prefix hit rate")
    ax2.set(xlabel="DP ranks (same total pool)", ylabel="max / mean prompt tokens",
            title="load imbalance")
    for ax in (ax1, ax2):
        ax.set_xticks(sorted({d["ranks"] for d in results["runs"]}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sglang_session_cache_bench.dp_scale",
        description="Session affinity across N DP ranks (N real caches) vs round_robin "
                    "and total_tokens at the same total pool.")
    p.add_argument("--ranks", default=",".join(map(str, DEFAULT_RANKS)),
                   help="comma-separated DP sizes (default 2,4,8)")
    p.add_argument("--pool", default=DEFAULT_POOL,
                   help="TOTAL pool: tokens or a %% of the trace footprint (default 24%%)")
    p.add_argument("--shape", choices=agentic.SHAPES, default="full")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma list of routing methods to compare (default: all of {METHODS})")
    p.add_argument("--inflight", type=int, default=DEFAULT_INFLIGHT,
                   help="requests counted as in flight for the load signal (default 16)")
    p.add_argument("--overload-factor", type=float, default=DEFAULT_OVERLOAD_FACTOR,
                   help="session affinity's overload guard, as "
                        f"--session-dp-affinity-overload-factor (default {DEFAULT_OVERLOAD_FACTOR})")
    p.add_argument("--trace", help="JSONL or Mooncake trace (default: generated)")
    add_trace_format_options(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small generated trace")
    p.add_argument("--out", default="bench_out")
    p.add_argument("--no-plot", action="store_true")
    return p


def _trace(args) -> Trace:
    trace = trace_from_args(args)
    if trace is not None:
        return trace
    # The agentic benchmark's generated trace, as its --quick / --seed make it.
    ns = agentic.build_parser().parse_args(
        (["--quick"] if args.quick else []) + ["--seed", str(args.seed)])
    return agentic.load_trace(ns)


def resolve_pool(text: str, trace: Trace, max_ranks: int) -> int:
    text = text.strip()
    if text.endswith("%"):
        pool = int(round(ideal_stats(trace)["footprint"] * float(text[:-1]) / 100.0))
    else:
        pool = int(text)
    # Every rank must hold the trace's longest request.
    return max(pool, max_ranks * agentic.min_pool_tokens(trace))


def main(argv: Optional[list] = None) -> int:
    args = build_parser().parse_args(argv)
    ranks = [int(x) for x in args.ranks.split(",") if x.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m!r}; choose from {METHODS}")
    if not ranks or min(ranks) < 1:
        raise SystemExit("--ranks: positive integers")
    try:
        trace = _trace(args)
    except TraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    pool = resolve_pool(args.pool, trace, max(ranks))
    results = run(trace, args.shape, pool, ranks, methods, args.inflight,
                  args.overload_factor)
    print(format_table(results))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, RESULTS_JSON), "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=1)
    print(f"\nresults: {os.path.join(args.out, RESULTS_JSON)}")
    if not args.no_plot:
        write_plot(results, os.path.join(args.out, PLOT_PNG))
        print(f"plot:    {os.path.join(args.out, PLOT_PNG)}")
    bad = results["single_rank"]["issues"] or any(d["issues"] for d in results["runs"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
