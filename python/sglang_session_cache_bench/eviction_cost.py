"""Per-eviction cost with the session cache off and on, side by side.

Builds real ``UnifiedRadixCache`` trees (FULL; FULL+SWA and FULL+Mamba for the
two LRU walks) with 10k and 100k leaves, references 0 %, 50 % or 100 % of
the leaves through the session tracker, evicts ``--warmup`` leaves on each side
untimed (so work a design defers past the first evictions shows in the timed
ones), then times single-leaf evictions. Off and on caches are measured
alternately, eviction by eviction, and each cell's ratio is the median of the
paired on/off ratios, so machine drift cancels out.  Two pairs
of trees serve the three fractions of a size (``_cells``); evictions are
timed in process CPU time; torch runs one intra-op thread (as in the agentic
benchmark).  SWA and Mamba cells also time the whole ``cache.evict`` call
the scheduler makes when only that pool runs short (0.5.16 rebuilds FULL's
leaf heap on it too; a session cache keeps it, ``full_leaf_heap``): what an
eviction costs a server, next to the walk that isolates the session work.

    python -m sglang_session_cache_bench.eviction_cost [--nodes 10000,100000]
        [--components full,swa,mamba] [--warmup 1200]

Target (issue 14): flag-on within 1.10x of flag-off in every cell, flat in the
referenced fraction.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from array import array

from sglang_session_cache_bench.agentic import write_json
from sglang_session_cache_bench.trace_files import non_negative_int, positive_int

#: Cache components a cell can evict (``--components``).
KINDS = ("full", "swa", "mamba")

FRACTIONS = (0.0, 0.5, 1.0)
WARMUP = 1200  # untimed evictions per side before a cell's timed ones
TOKENS_PER_LEAF = 4
GROUPS = 64  # leaves hang under 64 shared two-token prefixes


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build(kind: str, n_leaves: int, enable_session: bool):
    """A tree of ``n_leaves`` leaves inserted straight into the real cache."""
    import torch

    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang_session_cache_bench.harness import (
        make_full_cache,
        make_full_mamba_cache,
        make_swa_cache,
    )

    tokens = n_leaves * TOKENS_PER_LEAF + 4 * GROUPS + 64
    if kind == "full":
        h = make_full_cache(num_tokens=tokens, enable_session=enable_session, head_dim=1)
    elif kind == "mamba":
        h = make_full_mamba_cache(num_tokens=tokens, mamba_num_slots=n_leaves + 8,
                                  enable_session=enable_session, head_dim=1)
    else:
        h = make_swa_cache(num_tokens=tokens, page_size=1, sliding_window_size=2,
                           enable_session=enable_session, head_dim=1)
    cache, alloc = h.cache, h.allocator
    mamba = h.mamba_allocator if kind == "mamba" else None
    leaves = []
    for i in range(n_leaves):
        g = i % GROUPS
        ids = array("q", [g + 1, g + 1, 10_000 + i, 10_001 + i])
        value = alloc.alloc(TOKENS_PER_LEAF).to(torch.int64)
        params = InsertParams(key=RadixKey(ids), value=value)
        if mamba is not None:
            params.mamba_value = mamba.alloc(1)  # one state per leaf
        cache.insert(params)
        leaves.append(ids)
    return h, leaves


def reference(h, leaves, fraction: float, seed: int = 0) -> int:
    """Give ``fraction`` of the leaves a one-session reference each."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang_session_cache.patches.unified_cache import locate_node

    tracker = h.cache.session_ref_tracker
    if tracker is None:
        return 0
    # Measures bookkeeping with any share referenced: no protection bound,
    # protected from the first request, and room for one open session per
    # leaf (the server bound, MAX_OPEN_SESSIONS = 65,536, would release the
    # oldest sessions of a 100k tree as it is referenced).
    tracker.configure_protection(1.0, 1)
    tracker.max_open_sessions = max(tracker.max_open_sessions, len(leaves) + 1)
    rng = random.Random(seed)
    count = 0
    for i, ids in enumerate(leaves):
        sid = f"s{i}"
        want = rng.random() < fraction
        if want and sid not in tracker.generations:
            node = locate_node(h.cache, RadixKey(ids))
            if node is None:
                continue  # already evicted by an earlier cell
            tracker.open_radix_session(sid)
            for refs in tracker.index_owners:
                refs.register_session_leaf(sid, node)
            tracker.policy.on_registered(sid)
        if sid in tracker.generations:
            count += 1
    return count


def _one_victim_params(kind: str):
    """``EvictParams`` asking the timed component for a single token (Mamba:
    a single state), and the other pools for nothing."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    if kind == "full":
        return EvictParams(num_tokens=1)
    if kind == "mamba":
        return EvictParams(num_tokens=0, mamba_num=1)
    return EvictParams(num_tokens=0, swa_num_tokens=1)


def evict_once(h, kind: str, clock=time.process_time) -> float:
    """Seconds for one single-token eviction, in process CPU time (a shared
    box preempts a millisecond-long FULL eviction now and then; CPU time
    does not count that).

    FULL: the whole ``cache.evict`` call (0.5.16 rebuilds the leaf heap on
    every call; a session cache under ``lru`` keeps it). SWA / Mamba: that
    component's LRU walk alone — ``cache.evict`` would also run FULL's heap
    (a rebuild, off), which would hide the walk's cost."""
    if kind == "full":
        return evict_call_once(h, kind, clock)
    from sglang.srt.mem_cache.unified_cache_components import ComponentType

    cache = h.cache
    comp = cache.components[ComponentType.MAMBA if kind == "mamba" else ComponentType.SWA]
    params = _one_victim_params(kind)
    tracker = {ct: 0 for ct in cache.tree_components}
    start = clock()
    comp.drive_eviction(params, tracker)
    return clock() - start


def evict_call_once(h, kind: str, clock=time.process_time) -> float:
    """Seconds for one whole ``cache.evict`` call asking one component for a
    single token (state) and the others for none; for SWA / Mamba the call
    the scheduler makes when only that pool runs short.  0.5.16 runs every
    component's drive on every call, so FULL's leaf heap is rebuilt here too
    (O(leaves)) -- with the session cache off; on, the kept heap only looks
    at what changed."""
    params = _one_victim_params(kind)
    cache = h.cache
    start = clock()
    cache.evict(params)
    return clock() - start


def _paired(off, on, pairs: int, timed) -> tuple:
    """``pairs`` alternating off/on timings (who goes first alternates):
    the off times, the on times and the paired on/off ratios."""
    offs, ons, ratios = [], [], []
    for i in range(pairs):
        if i % 2:
            b = timed(on)
            a = timed(off)
        else:
            a = timed(off)
            b = timed(on)
        offs.append(a)
        ons.append(b)
        ratios.append(b / a)
    return offs, ons, ratios


def evict_untimed(h, kind: str, n_leaves: int) -> None:
    """Evict about ``n_leaves`` leaves in one call (each leaf holds two
    tokens of its own; Mamba counts states)."""
    if n_leaves <= 0:
        return
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cache = h.cache
    if kind == "full":
        cache.evict(EvictParams(num_tokens=2 * n_leaves))
        return
    from sglang.srt.mem_cache.unified_cache_components import ComponentType

    if kind == "mamba":
        comp = cache.components[ComponentType.MAMBA]
        params = EvictParams(num_tokens=0, mamba_num=n_leaves)
    else:
        comp = cache.components[ComponentType.SWA]
        params = EvictParams(num_tokens=0, swa_num_tokens=2 * n_leaves)
    comp.drive_eviction(params, {ct: 0 for ct in cache.tree_components})


def run(nodes=(10_000, 100_000), kinds=("full", "swa", "mamba"), rounds=5, seed=0,
        warmup=WARMUP) -> list[dict]:
    import gc
    import logging

    import torch

    logging.getLogger("sglang").setLevel(logging.WARNING)
    # The pools' index tensors pass 32k elements at 10k leaves: with more
    # than one intra-op thread every allocator torch.cat then pays a thread
    # hand-off, which made building a tree take 10-30x longer and swamped
    # the evictions timed here.  Same setting for off and on.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        for kind in kinds:
            for n in nodes:
                rows.extend(_cells(kind, n, rounds, seed, gc, warmup))
    finally:
        torch.set_num_threads(threads)
    return rows


def _pair_count(rounds: int, n: int, whole_call: bool) -> int:
    """Timed pairs for one cell: a whole-tree evict() call (FULL's walk, or
    SWA/Mamba's call that rebuilds FULL's heap) costs O(leaves), ~0.1 s at
    100k, so large trees get few; at most a tenth of the leaves, at least 4."""
    per_round = 4 if whole_call and n >= 50_000 else 100
    return max(4, min(rounds * per_round, n // 10))


def _cells(kind: str, n: int, rounds: int, seed: int, gc, warmup: int = WARMUP) -> list[dict]:
    """The three referenced fractions of one (component, size) on two pairs
    of identical trees: one pair serves 0 % and then 100 % (references are
    added to what the 0 % cell's evictions left), the other 50 %.  Adding
    references in leaf order keeps each insertion into the referenced LRU
    partition near one end; referencing the other half of an already half-
    referenced tree would place every leaf between two referenced ones, an
    O(partition) search each (fine per registration, minutes for 50k at
    once).  Each cell times at most 10 % of the leaves' evictions, after
    ``warmup`` untimed ones (at most a tenth of the tree) on each side."""
    # Off and on alternate eviction by eviction (A B A B ...); each pair
    # gives one ratio.  FULL costs O(leaves) per call: at 100k a call is
    # ~0.1 s and fewer pairs do; at 10k its paired ratios spread widely
    # (IQR 0.7-1.5 with 100 pairs), so it gets as many as SWA and Mamba.
    pairs = _pair_count(rounds, n, whole_call=kind == "full")
    # SWA / Mamba also time the whole evict() call, which rebuilds FULL's
    # heap (O(leaves)): FULL's pair count.
    call_pairs = 0 if kind == "full" else _pair_count(rounds, n, whole_call=True)
    warmup = min(warmup, n // 10)
    rows = []
    for fractions in ((0.0, 1.0), (0.5,)):
        t0 = time.perf_counter()
        off, leaves = build(kind, n, enable_session=False)
        on, _ = build(kind, n, enable_session=True)
        _log(f"[{kind} n={n}] built two trees in {time.perf_counter() - t0:.1f}s")
        for frac in fractions:
            rows.append(_cell(kind, n, frac, off, on, leaves, pairs, seed, gc, warmup,
                              call_pairs))
        del off, on
    return sorted(rows, key=lambda r: r["referenced_fraction"])


def _cell(kind, n, frac, off, on, leaves, pairs, seed, gc, warmup=WARMUP,
          call_pairs: int = 0) -> dict:
    t0 = time.perf_counter()
    referenced = reference(on, leaves, frac, seed)
    for h in (off, on):
        evict_untimed(h, kind, warmup)
    # Everything built so far is long-lived: keep the cyclic collector's
    # full passes off it, so a collection does not land in a timed eviction
    # on one side.
    gc.collect()
    gc.freeze()
    try:
        offs, ons, ratios = _paired(off, on, pairs, lambda h: evict_once(h, kind))
        calls = _paired(off, on, call_pairs, lambda h: evict_call_once(h, kind))
    finally:
        gc.unfreeze()
    on.cache.validate_session_state()
    row = {
        "component": kind,
        "nodes": n,
        "referenced_fraction": frac,
        "referenced_leaves": referenced,
        "off_us": statistics.median(offs) * 1e6,
        "on_us": statistics.median(ons) * 1e6,
        "ratio": statistics.median(ratios),
        "ratio_q1": statistics.quantiles(ratios, n=4)[0],
        "ratio_q3": statistics.quantiles(ratios, n=4)[2],
        # Total on / total off: counts what medians drop (work a design
        # batches into a few evictions), and a preempted eviction too.
        "total_ratio": sum(ons) / sum(offs),
        "pairs": pairs,
        "warmup": warmup,
    }
    if call_pairs:
        call_off, call_on, call_ratios = calls
        row.update({
            "call_off_us": statistics.median(call_off) * 1e6,
            "call_on_us": statistics.median(call_on) * 1e6,
            "call_ratio": statistics.median(call_ratios),
            "call_pairs": call_pairs,
        })
    call = f", evict() call {row['call_ratio']:.2f}" if call_pairs else ""
    _log(f"[{kind} n={n} ref={frac:.0%}] off {row['off_us']:.0f}us "
         f"on {row['on_us']:.0f}us ratio {row['ratio']:.2f}{call} "
         f"({time.perf_counter() - t0:.1f}s)")
    return row


def format_table(rows: list[dict]) -> str:
    lines = [
        "Per-eviction cost, session cache off vs on (on/off: median of paired ratios; "
        "total: sum on / sum off).  FULL times the whole cache.evict call; SWA and "
        "Mamba their LRU walk, and under 'evict() call' the whole call the scheduler "
        "makes (FULL's heap: rebuilt off, kept on)",
        f"{'component':<10}{'nodes':>8}{'ref %':>7}{'off us':>11}{'on us':>11}"
        f"{'on/off':>8}{'IQR':>13}{'total':>7}{'pairs':>7}"
        f"{'evict() call on/off':>21}",
    ]
    for r in rows:
        call = (f"{r['call_ratio']:>12.2f} ({r['call_pairs']})" if "call_ratio" in r
                else f"{'(same)':>12}")
        lines.append(
            f"{r['component']:<10}{r['nodes']:>8}{r['referenced_fraction']*100:>6.0f}%"
            f"{r['off_us']:>11.1f}{r['on_us']:>11.1f}{r['ratio']:>8.2f}"
            f"{r['ratio_q1']:>7.2f}-{r['ratio_q3']:<5.2f}{r['total_ratio']:>7.2f}{r['pairs']:>7}"
            f"{call:>21}"
        )
    worst = max(r["ratio"] for r in rows)
    lines.append(f"worst cell on/off: {worst:.2f} (target <= 1.10)")
    calls = [r.get("call_ratio", r["ratio"]) for r in rows]
    lines.append(f"worst cell per evict() call as the scheduler makes it: {max(calls):.2f}")
    return "\n".join(lines)


def _node_counts(text: str) -> tuple:
    """An argparse type: comma-separated leaf counts, each >= 1."""
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("give at least one leaf count")
    return tuple(positive_int(x.replace("_", "")) for x in parts)


def _kinds(text: str) -> tuple:
    kinds = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(
            f"unknown component(s) {bad}; choose from {', '.join(KINDS)}")
    return kinds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=_node_counts, default="10000,100000",
                   help="comma-separated leaf counts")
    p.add_argument("--components", type=_kinds, default="full,swa,mamba",
                   help="any of full, swa, mamba")
    p.add_argument("--rounds", type=positive_int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=non_negative_int, default=WARMUP,
                   help="untimed evictions per side before each cell's timed ones "
                        "(capped at a tenth of the tree)")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    rows = run(
        nodes=args.nodes,
        kinds=args.components,
        rounds=args.rounds,
        seed=args.seed,
        warmup=args.warmup,
    )
    print(format_table(rows))
    if args.json:
        write_json(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
