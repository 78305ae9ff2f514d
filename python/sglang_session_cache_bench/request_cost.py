"""Per-request CPU cost of the session cache on the agentic workload, off vs on,
paired.

The same seeded agentic trace (``sglang_session_cache_bench.agentic``'s
generator) is replayed through the real, patched cache for every shape (FULL,
FULL+SWA, FULL+SWA+Mamba) at one pool size under pressure, on two caches at
once: session cache off and on, **in lockstep** -- event by event, the side
that goes first alternating every event -- so machine drift and other jobs
on a shared box hit both sides alike.  One lockstep replay is one pair; a
shape's result is the median of ``--repeats`` paired on/off ratios (pairs
alternate which side starts).  On-runs use the server defaults of the
session flags (``--session-radix-cache-protect-from-turn auto``, protection
bound 0.9) unless ``--session-radix-cache-protect-from-turn`` says otherwise.

Timed: each event's cache work only (a request's arrival stamp, prefill,
decode steps and finish; closes; clock ticks), in process CPU time
(``time.process_time``; torch runs one intra-op thread).  Not timed: trace
generation, cache construction, the end-of-run checks (``check()``,
``validate_session_state()``, evict-all; both sides, after the replay).  The
cyclic garbage collector is paused during a pair and runs after it.

    python -m sglang_session_cache_bench.request_cost [--repeats 5] [--size 8%]
        [--shapes full,swa,swa_mamba] [--json FILE]

Target (issue 14): on/off <= 1.05 per shape.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

from sglang_session_cache_bench.agentic import (
    SHAPE_TITLES,
    SHAPES,
    from_turn_option,
    min_pool_tokens,
    parse_shapes,
    positive_int,
    replay_steps,
    resolve_sizes,
)
from sglang_session_cache.protection_policy import FROM_TURN_FIELD, normalize_from_turn
from sglang_session_cache_bench.trace import GeneratorConfig, generate_trace, ideal_stats

TARGET = 1.05


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def lockstep(trace, shape: str, pool: int, first_on: bool) -> dict:
    """Replay ``trace`` on an off and an on cache side by side, event by event
    (who goes first alternates every event), timing each event's cache work in
    process CPU time.  The cyclic garbage collector is paused while the two
    replays run (a collection would be charged to whichever side triggered
    it, and it walks both trees); it runs after them."""
    steps = {on: replay_steps(trace, shape, pool, on, timer=time.process_time)
             for on in (False, True)}
    done = {}
    gc.collect()
    gc.disable()
    try:
        for gen in steps.values():
            next(gen)  # builds the cache, stops before the first event
        order = (True, False) if first_on else (False, True)
        while len(done) < 2:
            for on in order:
                if on in done:
                    continue
                try:
                    next(steps[on])
                except StopIteration as stop:
                    done[on] = stop.value
            order = order[::-1]
    finally:
        gc.enable()
    gc.collect()
    for on, st in done.items():
        if st.issues:
            raise RuntimeError(f"{shape} session={'on' if on else 'off'}: {st.issues}")
    return done


def run(shapes=SHAPES, size="8%", repeats: int = 5, seed: int = 0,
        sessions=None, protect_from_turn=None) -> dict:
    import logging

    import torch

    import sglang_session_cache
    import sglang_session_cache_bench.harness as harness

    if not sglang_session_cache.activate():
        raise RuntimeError("the session-cache patches are not active")
    logging.getLogger("sglang").setLevel(logging.WARNING)
    cfg = GeneratorConfig(seed=seed)
    if sessions is not None:
        cfg.sessions = sessions
        cfg.concurrency = min(cfg.concurrency, sessions)
    trace = generate_trace(cfg)
    footprint = ideal_stats(trace)["footprint"]
    (pool,) = resolve_sizes([size], footprint, min_pool_tokens(trace))
    summary = trace.summary()
    _log(f"[request_cost] {summary['requests']} requests, pool {pool:,} tokens "
         f"({size} of a {footprint:,}-token footprint), {repeats} pairs per shape")
    # As in the agentic benchmark: one intra-op thread, same for off and on.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # The server defaults of the session flags, unless a turn is given.
    options = ({} if protect_from_turn is None
               else {FROM_TURN_FIELD: normalize_from_turn(protect_from_turn)})
    rows = []
    try:
        with harness.session_server_args(options):
            for shape in shapes:
                lockstep(trace, shape, pool, False)  # untimed warm-up pair
                offs, ons, ratios = [], [], []
                for i in range(repeats):
                    runs = lockstep(trace, shape, pool, first_on=i % 2 == 1)
                    ms = {on: 1000.0 * st.event_seconds / st.requests
                          for on, st in runs.items()}
                    hits = {on: st.hit_rate for on, st in runs.items()}
                    offs.append(ms[False])
                    ons.append(ms[True])
                    ratios.append(ms[True] / ms[False])
                    _log(f"[request_cost] {SHAPE_TITLES[shape]:<15} pair {i + 1}/{repeats}: "
                         f"off {ms[False]:.3f} ms on {ms[True]:.3f} ms "
                         f"ratio {ratios[-1]:.3f}")
                rows.append({
                    "shape": shape,
                    "off_ms": statistics.median(offs),
                    "on_ms": statistics.median(ons),
                    "ratio": statistics.median(ratios),
                    "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                    "pairs": repeats,
                    "off_hit_rate": hits[False],
                    "on_hit_rate": hits[True],
                })
    finally:
        torch.set_num_threads(threads)
        harness.release_server_args()
    return {"requests": summary["requests"], "pool_tokens": pool, "size": size,
            "seed": seed, "protect_from_turn": protect_from_turn, "rows": rows}


def format_table(result: dict) -> str:
    lines = [
        f"Per-request cost, session cache off vs on ({result['requests']} requests, "
        f"pool {result['pool_tokens']:,} tokens = {result['size']} of footprint; "
        f"median of paired on/off ratios"
        + (f"; on: protected from turn {result['protect_from_turn']}"
           if result.get("protect_from_turn") else "") + ")",
        f"{'shape':<16}{'off ms/req':>11}{'on ms/req':>11}{'on/off':>8}"
        f"{'range':>13}{'pairs':>7}{'hit off':>9}{'hit on':>8}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{SHAPE_TITLES[r['shape']]:<16}{r['off_ms']:>11.3f}{r['on_ms']:>11.3f}"
            f"{r['ratio']:>8.3f}{r['ratio_min']:>7.2f}-{r['ratio_max']:<5.2f}"
            f"{r['pairs']:>7}{r['off_hit_rate']:>9.3f}{r['on_hit_rate']:>8.3f}"
        )
    worst = max(r["ratio"] for r in result["rows"])
    lines.append(f"worst shape on/off: {worst:.3f} (target <= {TARGET:.2f})")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=parse_shapes, default=list(SHAPES),
                   help="comma list of full, swa, swa_mamba (default: all)")
    p.add_argument("--size", default="8%",
                   help="pool size: share of the trace footprint (e.g. 8%%) or tokens")
    p.add_argument("--repeats", type=positive_int, default=5,
                   help="off/on pairs per shape (default 5)")
    p.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
    p.add_argument("--sessions", type=positive_int, default=None,
                   help="agent sessions in the trace (default: the generator's)")
    p.add_argument("--session-radix-cache-protect-from-turn", type=from_turn_option, default=None,
                   metavar="N|auto", dest="protect_from_turn",
                   help="session on: protect from a session's N-th request (default: the "
                        "server default); a turn no session reaches measures the "
                        "machinery alone, with the off run's tree")
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)
    size = args.size if args.size.endswith("%") else int(args.size)
    t0 = time.perf_counter()
    result = run(args.shapes, size, args.repeats, args.seed, args.sessions,
                 args.protect_from_turn)
    print(format_table(result))
    _log(f"[request_cost] done in {time.perf_counter() - t0:.1f}s")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
