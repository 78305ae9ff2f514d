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
bound ``auto``) unless ``--session-radix-cache-protect-from-turn`` /
``--session-radix-cache-max-protected-fraction`` say otherwise.

Timed: each event's cache work only (a request's arrival stamp, prefill,
decode steps and finish; closes; clock ticks), in process CPU time
(``time.process_time``; torch runs one intra-op thread).  Not timed: trace
generation, cache construction, the end-of-run checks (``check()``,
``validate_session_state()``, evict-all; both sides, after the replay).  The
cyclic garbage collector is paused during a pair and runs after it.

    python -m sglang_session_cache_bench.request_cost [--repeats 5] [--size 8%]
        [--shapes full,swa,swa_mamba] [--equal-hit] [--breakdown] [--json FILE]

``--equal-hit`` adds a control to the same lockstep: session cache off on the
larger pool where it reuses as many prompt tokens as the on run (found by
untimed bisection), so a run can tell what the hits themselves cost SGLang's
own walks (control/off) from what the session machinery costs (on/control).
The evictions per request (deterministic) are printed for off and on.

``--breakdown`` then replays once more per side with a timer around every
session hook and SGLang entry point (``sglang_session_cache_bench.hook_profile``)
and prints where the on run's time goes, per request (with ``--equal-hit``,
the control's SGLang entry points too); those replays are not part of the
paired ratios.

Target (issue 14): on/off <= 1.05 per shape.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from typing import Optional

from sglang_session_cache_bench.agentic import (
    SHAPE_TITLES,
    SHAPES,
    fraction_option,
    from_turn_option,
    min_pool_tokens,
    parse_shapes,
    pool_size_option,
    positive_int,
    replay,
    replay_steps,
    resolve_sizes,
    write_json,
)
from sglang_session_cache.protection_policy import (
    FRACTION_FIELD,
    FROM_TURN_FIELD,
    normalize_fraction,
    normalize_from_turn,
)
from sglang_session_cache_bench import hook_profile
from sglang_session_cache_bench.trace import GeneratorConfig, generate_trace, ideal_stats

TARGET = 1.05
#: Key of the third side of ``lockstep``: session cache off, on the pool
#: where it reuses as much as the on run (``--equal-hit``).
EQUAL_HIT = "equal_hit"
_SIDE_NAMES = {False: "session=off", True: "session=on", EQUAL_HIT: "session=off, equal-hit pool"}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def lockstep(trace, shape: str, pool: int, first_on: bool,
             equal_hit_pool: Optional[int] = None, timer=time.process_time,
             before_step=None) -> dict:
    """Replay ``trace`` on an off and an on cache side by side, event by event
    (who goes first rotates every event), timing each event's cache work in
    process CPU time.  With ``equal_hit_pool`` a third cache, session cache
    off on that larger pool, replays alongside (key ``EQUAL_HIT``).  The
    cyclic garbage collector is paused while the replays run (a collection
    would be charged to whichever side triggered it, and it walks every
    tree); it runs after them.  ``before_step(name)``, when given, is
    called before each of a side's steps after the cache is built: one per
    trace event, then one that runs the end-of-run checks
    (``agentic.replay_steps``)."""
    sides = {False: (pool, False), True: (pool, True)}
    if equal_hit_pool is not None:
        sides[EQUAL_HIT] = (equal_hit_pool, False)
    steps = {name: replay_steps(trace, shape, p, on, timer=timer)
             for name, (p, on) in sides.items()}
    done = {}
    gc.collect()
    gc.disable()
    try:
        for gen in steps.values():
            next(gen)  # builds the cache, stops before the first event
        order = list(sides)
        if first_on:
            order.reverse()
        while len(done) < len(steps):
            for name in order:
                if name in done:
                    continue
                if before_step is not None:
                    before_step(name)
                try:
                    next(steps[name])
                except StopIteration as stop:
                    done[name] = stop.value
            order.append(order.pop(0))
    finally:
        gc.enable()
    gc.collect()
    for name, st in done.items():
        if st.issues:
            raise RuntimeError(f"{shape} {_SIDE_NAMES[name]}: {st.issues}")
    return done


def equal_hit_pool(trace, shape: str, pool: int, target_hit: float, limit: int) -> int:
    """The smallest pool (to 1/64 of the span searched) on which the session
    cache off reuses at least ``target_hit`` of the prompt tokens: the off
    run that buys the on run's hits with memory instead.  Untimed replays."""
    lo, hi = pool, limit
    if replay(trace, shape, hi, False).hit_rate < target_hit:
        return hi
    step = max(1, (hi - lo) // 64)
    while hi - lo > step:
        mid = (lo + hi) // 2
        if replay(trace, shape, mid, False).hit_rate >= target_hit:
            hi = mid
        else:
            lo = mid
    return hi


def run(shapes=SHAPES, size="8%", repeats: int = 5, seed: int = 0,
        sessions=None, protect_from_turn=None, equal_hit: bool = False,
        breakdown: bool = False, max_protected_fraction=None) -> dict:
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
    # The server defaults of the session flags, unless given.
    options = {}
    if protect_from_turn is not None:
        options[FROM_TURN_FIELD] = normalize_from_turn(protect_from_turn)
    if max_protected_fraction is not None:
        options[FRACTION_FIELD] = normalize_fraction(max_protected_fraction)
    rows = []
    try:
        with harness.session_server_args(options):
            for shape in shapes:
                warm = lockstep(trace, shape, pool, False)  # untimed warm-up pair
                eq_pool = None
                if equal_hit:
                    eq_pool = equal_hit_pool(trace, shape, pool, warm[True].hit_rate, footprint)
                    _log(f"[request_cost] {SHAPE_TITLES[shape]:<15} off reaches the on hit "
                         f"rate at a pool of {eq_pool:,} tokens")
                offs, ons, ratios, eqs, eq_ratios, hit_costs = [], [], [], [], [], []
                for i in range(repeats):
                    runs = lockstep(trace, shape, pool, first_on=i % 2 == 1,
                                    equal_hit_pool=eq_pool)
                    ms = {name: 1000.0 * st.event_seconds / st.requests
                          for name, st in runs.items()}
                    hits = {name: st.hit_rate for name, st in runs.items()}
                    offs.append(ms[False])
                    ons.append(ms[True])
                    ratios.append(ms[True] / ms[False])
                    line = (f"[request_cost] {SHAPE_TITLES[shape]:<15} pair {i + 1}/{repeats}: "
                            f"off {ms[False]:.3f} ms on {ms[True]:.3f} ms "
                            f"ratio {ratios[-1]:.3f}")
                    if eq_pool is not None:
                        eqs.append(ms[EQUAL_HIT])
                        eq_ratios.append(ms[True] / ms[EQUAL_HIT])
                        hit_costs.append(ms[EQUAL_HIT] / ms[False])
                        line += f"; off, equal hits {ms[EQUAL_HIT]:.3f} ms ratio {eq_ratios[-1]:.3f}"
                    _log(line)
                calls = {name: st.evict_calls / st.requests for name, st in runs.items()}
                row = {
                    "shape": shape,
                    "off_ms": statistics.median(offs),
                    "on_ms": statistics.median(ons),
                    "ratio": statistics.median(ratios),
                    "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                    "pairs": repeats,
                    "off_hit_rate": hits[False],
                    "on_hit_rate": hits[True],
                    # deterministic: same trace, same decisions every pair
                    "off_evict_calls_per_req": calls[False],
                    "on_evict_calls_per_req": calls[True],
                }
                if eq_pool is not None:
                    row.update({
                        "equal_hit_pool_tokens": eq_pool,
                        "equal_hit_off_ms": statistics.median(eqs),
                        "equal_hit_off_hit_rate": hits[EQUAL_HIT],
                        "equal_hit_ratio": statistics.median(eq_ratios),
                        "equal_hit_ratio_min": min(eq_ratios),
                        "equal_hit_ratio_max": max(eq_ratios),
                        # on/off is (on/control) x (control/off): the session
                        # machinery at equal hits, and what the extra hits
                        # cost SGLang's own code (the control pays it too).
                        "hit_cost_ratio": statistics.median(hit_costs),
                    })
                if breakdown:
                    _log(f"[request_cost] {SHAPE_TITLES[shape]:<15} breakdown: one more "
                         "pair with a timer around every hook")
                    row["breakdown"] = hook_profile.breakdown(trace, shape, pool, eq_pool)
                rows.append(row)
    finally:
        torch.set_num_threads(threads)
        harness.release_server_args()
    return {"requests": summary["requests"], "pool_tokens": pool, "size": size,
            "seed": seed, "protect_from_turn": protect_from_turn,
            "max_protected_fraction": max_protected_fraction,
            "equal_hit": equal_hit, "breakdown": breakdown, "rows": rows}


def format_table(result: dict) -> str:
    lines = [
        f"Per-request cost, session cache off vs on ({result['requests']} requests, "
        f"pool {result['pool_tokens']:,} tokens = {result['size']} of footprint; "
        f"median of paired on/off ratios"
        + (f"; on: protected from turn {result['protect_from_turn']}"
           if result.get("protect_from_turn") else "")
        + (f"; on: max protected fraction {result['max_protected_fraction']}"
           if result.get("max_protected_fraction") else "") + ")",
        f"{'shape':<16}{'off ms/req':>11}{'on ms/req':>11}{'on/off':>8}"
        f"{'range':>13}{'pairs':>7}{'hit off':>9}{'hit on':>8}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{SHAPE_TITLES[r['shape']]:<16}{r['off_ms']:>11.3f}{r['on_ms']:>11.3f}"
            f"{r['ratio']:>8.3f}{r['ratio_min']:>7.2f}-{r['ratio_max']:<5.2f}"
            f"{r['pairs']:>7}{r['off_hit_rate']:>9.3f}{r['on_hit_rate']:>8.3f}"
        )
    lines.append("evictions per request (off -> on): " + ", ".join(
        f"{SHAPE_TITLES[r['shape']]} {r['off_evict_calls_per_req']:.2f} -> "
        f"{r['on_evict_calls_per_req']:.2f}" for r in result["rows"]))
    eq_rows = [r for r in result["rows"] if "equal_hit_ratio" in r]
    if eq_rows:
        lines.append("Control: session cache off on the pool where it reuses as much as on "
                     "(memory instead of sessions), in the same lockstep")
        lines.append(f"{'shape':<16}{'pool':>9}{'hit':>7}{'off ms/req':>11}"
                     f"{'on/off':>8}{'range':>13}{'control/off':>13}")
        for r in eq_rows:
            lines.append(
                f"{SHAPE_TITLES[r['shape']]:<16}{r['equal_hit_pool_tokens']:>9,}"
                f"{r['equal_hit_off_hit_rate']:>7.3f}{r['equal_hit_off_ms']:>11.3f}"
                f"{r['equal_hit_ratio']:>8.3f}{r['equal_hit_ratio_min']:>7.2f}-"
                f"{r['equal_hit_ratio_max']:<5.2f}{r['hit_cost_ratio']:>13.3f}"
            )
        lines.append("on/off = (on/off at equal hits, the session machinery) x "
                     "(control/off, what the extra hits cost SGLang itself); medians "
                     "of the paired ratios, so the product is close, not exact")
    worst = max(r["ratio"] for r in result["rows"])
    lines.append(f"worst shape on/off: {worst:.3f} (target <= {TARGET:.2f})")
    for r in result["rows"]:
        if "breakdown" in r:
            lines.append(hook_profile.format_breakdown(SHAPE_TITLES[r["shape"]],
                                                       r["breakdown"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=parse_shapes, default=list(SHAPES),
                   help="comma list of full, swa, swa_mamba (default: all)")
    p.add_argument("--size", type=pool_size_option, default="8%",
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
    p.add_argument("--session-radix-cache-max-protected-fraction", type=fraction_option,
                   default=None, metavar="F|auto", dest="max_protected_fraction",
                   help="session on: the protection bound (default: the server default, "
                        "auto); a fixed F keeps no ghosts and learns nothing, which "
                        "measures what the learned bound costs")
    p.add_argument("--equal-hit", action="store_true",
                   help="add a control: session cache off on the (larger) pool where it "
                        "reuses as much as on, timed in the same lockstep")
    p.add_argument("--breakdown", action="store_true",
                   help="after the pairs, replay once more per side with a timer around "
                        "each session hook and SGLang entry point, and print where the "
                        "on run's time goes (with --equal-hit, next to the control's "
                        "SGLang entry points; not part of the paired ratios)")
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)
    size = args.size
    t0 = time.perf_counter()
    result = run(args.shapes, size, args.repeats, args.seed, args.sessions,
                 args.protect_from_turn, args.equal_hit, args.breakdown,
                 args.max_protected_fraction)
    print(format_table(result))
    _log(f"[request_cost] done in {time.perf_counter() - t0:.1f}s")
    if args.json:
        write_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
