"""Trace time for the replay: the one place where the benchmark feeds time
to the session cache.

The replay runs requests back to back, far faster than they arrived; what the
session TTL must see is the time *in the trace* (generated clocks, JSONL
``time``, Mooncake ``timestamp``). ``TraceClock`` holds it; the replay
advances it before every event, and ``attach`` sets the cache's TTL and
delivers every advance through ``cache.advance_session_clock`` -- the entry
point the scheduler uses for its shared clock tick before it processes a
batch of arrivals -- so expiry happens at the same points as on a server.
"""

from __future__ import annotations

from typing import Callable, Optional


class TraceClock:
    """Seconds of trace time; never goes backwards."""

    __slots__ = ("now", "_deliver")

    def __init__(self, start: float = 0.0):
        self.now = float(start)
        self._deliver: Optional[Callable[[float], int]] = None

    def __call__(self) -> float:
        return self.now

    def advance(self, t: float) -> None:
        if t > self.now:
            self.now = t
            if self._deliver is not None:
                self._deliver(t)


def attach(cache, clock: TraceClock, ttl: Optional[float]) -> None:
    """Drive ``cache``'s session TTL from ``clock``; a cache without the
    session tracker (session cache off) is left alone."""
    if getattr(cache, "session_ref_tracker", None) is None:
        return
    cache.session_ref_tracker.set_ttl(ttl)
    cache.advance_session_clock(clock.now)
    clock._deliver = cache.advance_session_clock


__all__ = ["TraceClock", "attach"]
