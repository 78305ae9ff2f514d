"""Trace time for the replay: the one place where the benchmark feeds time
to the session cache.

The replay runs requests back to back, far faster than they arrived; what the
session TTL must see is the time *in the trace* (generated clocks, JSONL
``time``, Mooncake ``timestamp``). ``TraceClock`` holds it; the replay
advances it before every event, and ``attach`` makes the cache's session
tracker read it and sets the TTL. If the way the cache learns the time
changes (for example from a time stamped on each request), only ``attach``
and ``TraceClock.advance`` change.
"""

from __future__ import annotations

from typing import Optional


class TraceClock:
    """Seconds of trace time; never goes backwards."""

    __slots__ = ("now",)

    def __init__(self, start: float = 0.0):
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, t: float) -> None:
        if t > self.now:
            self.now = t


def attach(cache, clock: TraceClock, ttl: Optional[float]) -> None:
    """Drive ``cache``'s session TTL from ``clock``; a cache without the
    session tracker (session cache off) is left alone."""
    tracker = getattr(cache, "session_ref_tracker", None)
    if tracker is None:
        return
    tracker.clock = clock
    tracker.set_ttl(ttl)


__all__ = ["TraceClock", "attach"]
