"""When an open session becomes due for TTL expiry, decided on a shared clock.

Every TP/PP rank keeps its own radix tree and SGLang relies on the trees
staying identical, so expiry must not read a rank's own clock.  Time here is
``now``: a value that only moves when a scheduler-ordered event delivers it
(``advance``).  In a server the value is read once on the rank that receives
requests from the tokenizer and travels with the request batch to every other
rank (see ``patches/session_clock.py``), so all ranks see the same values in
the same order and expire the same sessions at the same step.

A session is idle only with no request in flight; its idle time starts at
the arrival/finish that left it with nothing in flight.  Deadlines sit in a
heap with lazy deletion: ``advance`` pops only what is due (O(1) when nothing
is), every activity pushes one entry, and the heap is rebuilt when stale
entries outnumber live ones, so it stays within 2x the open sessions.

A session with requests in flight but no arrival or finish for
``busy_leak_s`` is presumed leaked (a request that left the scheduler without
a finish) and becomes due as well; that bounds what a lost finish can hold.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Optional

#: Requests in flight with no arrival/finish of the session for this long are
#: presumed lost (a long decode or a queued request is far shorter).
BUSY_LEAK_TIMEOUT_S = 6 * 3600.0


class SharedClockTick:
    """The shared clock value, appended to a polled request batch on the rank
    that reads the tokenizer socket and consumed by every rank's scheduler
    before the batch's requests (``patches/session_clock.py``)."""

    __slots__ = ("t",)

    def __init__(self, t: float):
        self.t = t

    def __reduce__(self):
        return (SharedClockTick, (self.t,))

    def __repr__(self):
        return f"SharedClockTick({self.t!r})"


class _Activity:
    __slots__ = ("inflight", "last", "ttl", "deadline", "seq")

    def __init__(self, now: float, ttl: Optional[float]):
        self.inflight = 0
        self.last = now
        self.ttl = ttl  # the session's own timeout; None: the global TTL
        self.deadline: Optional[float] = None
        self.seq = 0


class IdleSchedule:
    def __init__(self, ttl: Optional[float] = None, busy_leak_s: float = BUSY_LEAK_TIMEOUT_S):
        self.ttl = ttl
        self.busy_leak_s = busy_leak_s
        self.now = 0.0
        self.sessions: dict[str, _Activity] = {}
        self._heap: list = []
        self._seq = itertools.count(1)

    # ---- membership ----

    def add(self, sid: str, ttl: Optional[float] = None) -> None:
        act = _Activity(self.now, ttl)
        self.sessions[sid] = act
        self._reschedule(sid, act)

    def remove(self, sid: str) -> None:
        self.sessions.pop(sid, None)  # its heap entries go stale
        # Closes shrink the bound too, not only pushes grow the heap.
        if len(self._heap) > 2 * len(self.sessions) + 64:
            self._rebuild()

    def clear(self) -> None:
        self.sessions.clear()
        self._heap.clear()

    # ---- activity ----

    def arrive(self, sid: str) -> None:
        act = self.sessions.get(sid)
        if act is not None:
            act.inflight += 1
            act.last = self.now
            self._reschedule(sid, act)

    def finish(self, sid: str) -> None:
        act = self.sessions.get(sid)
        if act is not None:
            if act.inflight > 0:
                act.inflight -= 1
            act.last = self.now
            self._reschedule(sid, act)

    def touch(self, sid: str) -> None:
        act = self.sessions.get(sid)
        if act is not None:
            act.last = self.now
            self._reschedule(sid, act)

    def inflight(self, sid: str) -> int:
        act = self.sessions.get(sid)
        return 0 if act is None else act.inflight

    def set_ttl(self, ttl: Optional[float]) -> None:
        """New global TTL; idle time restarts now for every open session."""
        self.ttl = ttl
        self._heap.clear()
        for sid, act in self.sessions.items():
            act.last = self.now
            self._reschedule(sid, act)

    # ---- time ----

    def advance(self, t: float) -> list:
        """Move the shared clock to ``t`` (never backwards) and return the
        sessions now due, earliest deadline first; they stay members until
        ``remove``."""
        if t > self.now:
            self.now = t
        heap = self._heap
        due = []
        while heap and heap[0][0] <= self.now:
            deadline, seq, sid = heapq.heappop(heap)
            act = self.sessions.get(sid)
            if act is not None and act.seq == seq:
                act.deadline = None
                due.append(sid)
        return due

    def _reschedule(self, sid: str, act: _Activity) -> None:
        ttl = act.ttl if act.ttl is not None else self.ttl
        if act.inflight:
            deadline = act.last + self.busy_leak_s if ttl is not None else None
        else:
            deadline = act.last + ttl if ttl is not None else None
        act.deadline = deadline
        act.seq = next(self._seq)  # older heap entries of this session go stale
        if deadline is None:
            return
        heapq.heappush(self._heap, (deadline, act.seq, sid))
        if len(self._heap) > 2 * len(self.sessions) + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [
            (act.deadline, act.seq, sid)
            for sid, act in self.sessions.items()
            if act.deadline is not None
        ]
        heapq.heapify(self._heap)

    def heap_size(self) -> int:
        return len(self._heap)


__all__ = ["BUSY_LEAK_TIMEOUT_S", "IdleSchedule", "SharedClockTick"]
