"""Where the session cache's per-request time goes: time inside each session
hook, and inside the SGLang entry points they run in, from an off and an on
replay with a timer around each (``request_cost --breakdown``; with
``--equal-hit`` the control's entry points too, where the extra hits' cost to
SGLang's own walks shows apart from the hooks).

Times are inclusive (a row counts what it calls).  The hook rows do not nest
in one another; the "of which" rows (bound enforcement, LRU partition moves)
run inside several of them and are listed apart.  The SGLang rows contain the
hooks that run inside them (a match its ghost check, a finish its
registration, an eviction its ghost records and hand-overs).  Timers and
event times are wall clock (``perf_counter``, about 0.05 us a reading; a
CPU-time reading costs 0.6 us, too much around a hook of a few), and the two
sides replay in lockstep, as the paired runs do, but once: a single pair.
The timers themselves add a little, so these replays are never the paired,
timed ones.
"""

from __future__ import annotations

import contextlib
import functools
import time

#: (label, class, method).  Top-level hooks: none of them runs inside
#: another (their sum is the hooks' total).
HOOKS = (
    ("arrival stamp", "UnifiedSessionRefTracker", "ensure_session_generation"),
    ("finish: session checks", "UnifiedSessionRefTracker", "should_register"),
    ("finish: registration", "UnifiedSessionRefTracker", "register_checked"),
    ("finish: in-flight count", "UnifiedSessionRefTracker", "request_finished"),
    ("match: ghost check", "UnifiedSessionRefTracker", "on_match"),
    ("eviction: ghost record", "UnifiedSessionRefTracker", "on_unreferenced_evict"),
    ("eviction: deleted-leaf hand-over", "UnifiedSessionRefTracker", "on_node_deleted"),
    ("eviction: in-place relocation", "UnifiedSessionRefTracker", "on_component_evict"),
    ("eviction: bound check", "UnifiedSessionRefTracker", "enforce_protection_bound"),
    ("node split", "UnifiedSessionRefTracker", "on_split"),
    ("close", "UnifiedSessionRefTracker", "release_radix_session"),
    ("shared clock / TTL", "UnifiedSessionRefTracker", "advance_clock"),
)
#: Inside some of the hooks above: the protection bound withdrawing sessions
#: (registration, ghost check, arrival, bound check), and nodes moving
#: between the LRU partitions as their references come and go (registration,
#: close, withdrawal, relocation; SWA/Mamba lists only).
NESTED = (
    ("of which: bound enforcement", "ProtectionPolicy", "enforce"),
    ("of which: LRU partition moves", "PartitionedLRUList", "move_to_partition"),
)
_LRU_UPDATES = "LRU list updates"
#: SGLang's own entry points, timed on both sides (a label may cover several
#: methods).  The LRU rows are the SWA/Mamba lists' updates on match, insert
#: and eviction: the stock list off, the partitioned one on.
SGLANG = (
    ("match_prefix", "UnifiedRadixCache", "match_prefix"),
    ("cache_finished_req", "UnifiedRadixCache", "cache_finished_req"),
    ("evict", "UnifiedRadixCache", "evict"),
    *((_LRU_UPDATES, "UnifiedLRUList", name) for name in (
        "insert_mru", "remove_node", "reset_node_mru",
        "reset_node_and_parents_mru", "reset_node_and_window_ancestors_mru")),
    # The partitioned list's own versions (they do not call the stock ones).
    (_LRU_UPDATES, "PartitionedLRUList", "reset_node_and_parents_mru"),
    (_LRU_UPDATES, "PartitionedLRUList", "reset_node_and_window_ancestors_mru"),
)


def _owner(name: str):
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedLRUList, UnifiedRadixCache
    from sglang_session_cache.partitioned_lru import PartitionedLRUList
    from sglang_session_cache.protection_policy import ProtectionPolicy
    from sglang_session_cache.session_tracker import UnifiedSessionRefTracker

    return {
        "UnifiedSessionRefTracker": UnifiedSessionRefTracker,
        "ProtectionPolicy": ProtectionPolicy,
        "PartitionedLRUList": PartitionedLRUList,
        "UnifiedRadixCache": UnifiedRadixCache,
        "UnifiedLRUList": UnifiedLRUList,
    }[name]


class MethodTimers:
    """``{label: [calls, ns]}`` per side; calls count for ``side`` (set it
    before running a side's work; ``None`` for calls to leave out)."""

    def __init__(self, labels):
        self.labels = tuple(dict.fromkeys(labels))
        self.side = "all"
        self._sides: dict = {}

    def slot(self, label: str) -> list:
        rows = self._sides.get(self.side)
        if rows is None:
            rows = self._sides[self.side] = {label: [0, 0] for label in self.labels}
        return rows[label]

    def rows(self, side="all") -> dict:
        return self._sides.get(side) or {label: [0, 0] for label in self.labels}


@contextlib.contextmanager
def timed_methods(targets, clock=time.perf_counter_ns):
    """Within the block, a timer around every ``(label, class, method)`` of
    ``targets`` (methods given one label share its row); yields the
    ``MethodTimers``.  The classes are restored afterwards (also on an
    exception)."""
    timers = MethodTimers(label for label, _, _ in targets)
    saved = []
    try:
        for label, cls, name in targets:
            own = cls.__dict__.get(name)
            orig = getattr(cls, name)
            saved.append((cls, name, own))
            setattr(cls, name, _timer(orig, label, timers, clock))
        yield timers
    finally:
        for cls, name, own in reversed(saved):
            if own is None:
                delattr(cls, name)
            else:
                setattr(cls, name, own)


def _timer(fn, label: str, timers: MethodTimers, clock):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            slot = timers.slot(label)
            slot[0] += 1
            slot[1] += clock() - t0

    return timed


def breakdown(trace, shape: str, pool: int, equal_hit_pool=None) -> dict:
    """An off and an on replay of ``trace`` in lockstep (event by event, who
    goes first alternating, the cyclic collector paused: ``request_cost``'s
    own ``lockstep``), with the timers in place, counted per side up to the
    end of the trace (the end-of-run checks are left out).  Per request: calls and
    microseconds of every hook (on) and SGLang entry point (every side), and
    each side's event time.  With ``equal_hit_pool`` the equal-hit control
    (session cache off on that pool) replays alongside as a third side,
    ``equal_hit``: its SGLang rows next to on's show what the extra hits
    cost SGLang's own walks, apart from the hooks."""
    from sglang_session_cache_bench.request_cost import EQUAL_HIT, lockstep

    hook_targets = [(label, _owner(cls), name) for label, cls, name in HOOKS + NESTED]
    sglang_targets = [(label, _owner(cls), name) for label, cls, name in SGLANG]
    sglang_labels = {label for label, _, _ in SGLANG}
    events = len(trace.events)
    taken: dict = {}
    with timed_methods(sglang_targets + hook_targets) as timers:

        def before_step(name):
            # One step per trace event; the one after runs the checks: not counted.
            timers.side = name if taken.get(name, 0) < events else None
            taken[name] = taken.get(name, 0) + 1

        done = lockstep(trace, shape, pool, first_on=False, equal_hit_pool=equal_hit_pool,
                        timer=time.perf_counter, before_step=before_step)
    out = {"hooks": {}, "sglang": {}}
    for name, stats in done.items():
        n = max(1, stats.requests)
        side = {False: "off", True: "on", EQUAL_HIT: "equal_hit"}[name]
        out[f"{side}_us"] = 1e6 * stats.event_seconds / n
        for label, (calls, ns) in timers.rows(name).items():
            row = {"calls": calls / n, "us": ns / 1000 / n}
            if label in sglang_labels:
                out["sglang"].setdefault(label, {})[side] = row
            elif side == "on":
                out["hooks"][label] = row
    top = {label for label, _, _ in HOOKS}
    out["hooks_total_us"] = sum(r["us"] for k, r in out["hooks"].items() if k in top)
    return out


def format_breakdown(title: str, b: dict) -> str:
    on_us = b["on_us"]
    lines = [
        f"{title}: where the on run's time goes (one more off/on pair in lockstep, a "
        f"timer around each hook; wall time: off {b['off_us']:.0f} us/req, on "
        f"{on_us:.0f} us/req)",
        f"  {'session hook':<36}{'calls/req':>10}{'us/req':>9}{'% of on':>9}",
    ]
    for label, r in b["hooks"].items():
        if not r["calls"]:
            continue
        lines.append(f"  {label:<36}{r['calls']:>10.2f}{r['us']:>9.1f}"
                     f"{100 * r['us'] / on_us:>8.1f}%")
    total = b["hooks_total_us"]
    lines.append(f"  {'session hooks, total':<36}{'':>10}{total:>9.1f}{100 * total / on_us:>8.1f}%")
    control = "equal_hit_us" in b
    sides = ("off", "on", "equal_hit") if control else ("off", "on")
    heads = {"off": "off calls", "on": "on calls", "equal_hit": "eq. calls"}
    lines.append(f"  {'SGLang entry point (with its hooks)':<36}"
                 + "".join(f"{heads[side]:>10}{'us/req':>9}" for side in sides))
    for label, row in b["sglang"].items():
        if not any(row[side]["calls"] for side in sides):
            continue  # e.g. no SWA/Mamba LRU lists on a FULL tree
        lines.append(f"  {label:<36}" + "".join(
            f"{row[side]['calls']:>10.2f}{row[side]['us']:>9.1f}" for side in sides))
    if control:
        lines.append(f"  (eq.: session cache off on the equal-hit pool, wall time "
                     f"{b['equal_hit_us']:.0f} us/req)")
    return "\n".join(lines)


__all__ = ["HOOKS", "NESTED", "SGLANG", "MethodTimers", "breakdown", "format_breakdown",
           "timed_methods"]
