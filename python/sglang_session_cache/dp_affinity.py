"""Session affinity across data-parallel ranks: the routing policy.

With ``--dp-size N`` every DP rank has its own radix cache, so a session's
next turn only reuses its KV if it lands on the rank that served the previous
one.  ``SessionAffinity`` keeps one binding per session, ``session -> rank``:

* the first request of a session binds it to the least-loaded active rank,
  by the load the caller passes (the controller's own ``DPBudget``); equal
  loads (an idle server) go to the rank with the fewest bound sessions, so
  sessions that start on an idle server still spread;
* later requests go to the bound rank, unless that rank is overloaded or no
  longer active; then the session is rebound to the least-loaded rank
  (counted, and logged in aggregate by the caller).  Overloaded means all
  three: its load is above ``overload_factor`` x the mean load of the other
  active ranks;
  it exceeds the least-loaded rank's by more than the request's own tokens
  (moving a session costs a prefill of its whole prompt on the new rank, so
  a move must at least save that much queue); and it is at least
  ``min_load`` (a lightly used rank is not overloaded however idle the others
  are -- without this floor one busy session would bounce between ranks);
* a binding ends on ``close(session)``, when no request of the session was
  routed for ``ttl`` seconds (the session cache's TTL, or the session's own
  ``/open_session`` timeout, announced by ``open``: the ranks expire such a
  session by that timeout, so its binding lasts as long), or when more than
  ``max_bindings`` sessions are bound (least recently routed first);
* a binding that ended by the TTL leaves its rank behind as a hint: the
  session's next request goes back there (counted as ``resumed``) unless
  that rank is overloaded or no longer active.  The ranks count a session's
  idle time from its last *finish*, this table from its last *routing*, so a
  turn that ran long can see its binding end while its rank still holds the
  session's KV -- referenced, or as ordinary LRU data after the rank's own
  TTL -- and that rank is still where its next turn reuses the most;
* a **kept** binding (``keep=True``: a classic ``/open_session`` session, whose
  turns build on state only the rank that served it holds -- elsewhere the
  next turn fails or loses its context) is never moved by the overload guard
  and never expires by the TTL; it ends on ``close`` or, only once no other
  binding is left to drop, by the cap (oldest first: the bindings of classic
  sessions abandoned without a close end there).  It still moves off a rank that is no
  longer active (the state is gone with the rank);
* an explicit rank (``follow``: a request's ``routed_dp_rank``) moves the
  binding there, since that turn's KV lands there.

The policy is pure bookkeeping: it does not send anything and does not read a
clock of its own (``now`` is passed in), so the benchmark drives the very same
object as the controller.  Bindings under the shared TTL live in one
``OrderedDict`` ordered by last use, so expiry pops from the front and is O(1)
when nothing is due; bindings with a timeout of their own sit in a second one,
and a heap of their due times keeps their expiry O(log n).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

DEFAULT_OVERLOAD_FACTOR = 3.0
DEFAULT_MAX_BINDINGS = 100_000


@dataclass
class AffinityCounters:
    bound: int = 0  # first turns bound to the least-loaded rank
    followed: int = 0  # requests that went to their bound rank
    rebound_overload: int = 0  # overload guard moved the session
    rebound_inactive: int = 0  # bound rank no longer active
    rebound_explicit: int = 0  # a request's routed_dp_rank moved the session
    closed: int = 0  # bindings ended by /close_session
    expired: int = 0  # bindings ended by the TTL
    resumed: int = 0  # sessions routed back to the rank of their expired binding
    evicted: int = 0  # bindings dropped by the size cap (LRU)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class _Binding:
    # ttl: the session's own timeout (None: the shared TTL); due: the expiry
    # time its live heap entry was pushed with (older entries are stale).
    __slots__ = ("rank", "last", "ttl", "due")

    def __init__(self, rank: int, last: float):
        self.rank = rank
        self.last = last
        self.ttl = None  # set with the timed table (SessionAffinity._time)
        self.due = None


class SessionAffinity:
    """``session -> DP rank`` bindings with an overload guard; see module doc.

    ``overload_factor`` <= 0 turns the guard off; ``ttl`` ``None`` keeps
    bindings until closed or pushed out by the cap.
    """

    def __init__(
        self,
        overload_factor: float = DEFAULT_OVERLOAD_FACTOR,
        max_bindings: int = DEFAULT_MAX_BINDINGS,
        ttl: Optional[float] = None,
        min_load: float = 0,
    ):
        if max_bindings < 1:
            raise ValueError(f"max_bindings must be >= 1, got {max_bindings}")
        self.overload_factor = float(overload_factor)
        self.max_bindings = int(max_bindings)
        self.ttl = ttl
        self.min_load = min_load
        self.counters = AffinityCounters()
        # Bindings under the shared TTL, those with a timeout of their own,
        # and kept ones, each ordered by last use (a binding whose timeout
        # arrives after it was bound joins the timed table at its end; only
        # the cap reads that order, and the heap decides expiry).
        self._bindings: "OrderedDict[str, _Binding]" = OrderedDict()
        self._timed: "OrderedDict[str, _Binding]" = OrderedDict()
        self._kept: "OrderedDict[str, _Binding]" = OrderedDict()
        self._due: list = []  # heap of (due, session) for the timed ones
        # Timeouts announced by /open_session, for sessions bound or not yet
        # (at most max_bindings, oldest dropped).
        self._timeouts: "OrderedDict[str, float]" = OrderedDict()
        self._bound_per_rank: dict = {}  # rank -> bindings, the tie-breaker
        # session -> rank of its binding that ended by the TTL (at most
        # max_bindings, oldest dropped): where its next request goes back to.
        self._expired_rank: "OrderedDict[str, int]" = OrderedDict()

    def __len__(self) -> int:
        return len(self._bindings) + len(self._timed) + len(self._kept)

    def _get(self, session_id: str) -> Optional[_Binding]:
        return (self._bindings.get(session_id) or self._timed.get(session_id)
                or self._kept.get(session_id))

    def rank_of(self, session_id: str) -> Optional[int]:
        b = self._get(session_id)
        return None if b is None else b.rank

    def timeout_of(self, session_id: str) -> Optional[float]:
        """The session's own timeout (``open``), or ``None``."""
        return self._timeouts.get(session_id)

    def open(self, session_id: str, timeout: Optional[float]) -> None:
        """``/open_session`` with ``timeout`` seconds (``None``: none).  Like
        the ranks, a session already open with a timeout keeps it; a first
        timeout applies to its binding from now on."""
        if timeout is None or session_id in self._timeouts:
            return
        self._timeouts[session_id] = timeout
        while len(self._timeouts) > self.max_bindings:
            self._timeouts.popitem(last=False)
        b = self._bindings.pop(session_id, None)
        if b is not None:
            self._time(session_id, b, timeout)

    def _time(self, session_id: str, b: _Binding, timeout: float) -> None:
        b.ttl = timeout
        b.due = b.last + timeout
        self._timed[session_id] = b
        due = self._due
        if len(due) > 2 * len(self._timed) + 64:
            # Entries of bindings that ended early pile up until their due
            # time; rebuild from the live ones instead.
            due[:] = [(t.due, sid) for sid, t in self._timed.items() if sid != session_id]
            heapq.heapify(due)
        heapq.heappush(due, (b.due, session_id))

    def is_kept(self, session_id: str) -> bool:
        return session_id in self._kept

    def _lookup(self, session_id: str, keep: bool) -> Optional[_Binding]:
        """The binding of ``session_id``, moved to the end of its table (and
        into the kept table when ``keep``)."""
        b = self._kept.get(session_id)
        if b is not None:
            self._kept.move_to_end(session_id)
            return b
        for table in (self._bindings, self._timed):
            b = table.get(session_id)
            if b is not None:
                if keep:
                    del table[session_id]
                    self._kept[session_id] = b
                else:
                    table.move_to_end(session_id)
                return b
        return None

    def _add(self, session_id: str, rank: int, now: float, keep: bool) -> None:
        if len(self) >= self.max_bindings:
            # Least recently routed first; kept bindings only when no other
            # is left (an abandoned classic session, never closed, ends here).
            table = self._oldest_expiring() or self._kept
            sid, old = table.popitem(last=False)
            if table is self._timed:
                self._timeouts.pop(sid, None)
            self._count(old.rank, -1)
            self.counters.evicted += 1
        b = _Binding(rank, now)
        if keep:
            self._kept[session_id] = b
        else:
            timeout = self._timeouts.get(session_id)
            if timeout is None:
                self._bindings[session_id] = b
            else:
                self._time(session_id, b, timeout)
        self._count(rank, +1)

    def _oldest_expiring(self) -> Optional[OrderedDict]:
        """The table holding the least recently routed expiring binding."""
        plain, timed = self._bindings, self._timed
        if not plain or not timed:
            return plain or timed or None
        first_plain = next(iter(plain.values()))
        first_timed = next(iter(timed.values()))
        return timed if first_timed.last < first_plain.last else plain

    def route(
        self,
        session_id: str,
        active: Sequence[int],
        loads: Sequence[float],
        now: float,
        cost: float = 0,
        keep: bool = False,
    ) -> int:
        """The rank for a request of ``session_id``.

        ``active``: ranks that may take requests (non-empty); ``loads[r]``:
        rank ``r``'s load (any number; means are taken over ``active``); ``cost``: what a move would recompute (the request's
        prompt tokens, in the units of ``loads``); ``keep``: the binding is
        kept (see the module doc).  Ties go to the lowest rank, so the choice
        is a pure function of the inputs.
        """
        if not active:
            raise RuntimeError("No active DP ranks to route a session to.")
        self.expire(now)
        b = self._lookup(session_id, keep)
        c = self.counters
        if b is None:
            rank = self._expired_rank.pop(session_id, None)
            if rank is not None and rank in active and (
                keep or not self._overloaded(rank, active, loads, cost)
            ):
                c.resumed += 1
            else:
                rank = self._least_loaded(active, loads)
                c.bound += 1
            self._add(session_id, rank, now, keep)
            return rank
        if b.rank not in active:
            self._move(b, self._least_loaded(active, loads))
            c.rebound_inactive += 1
        elif not self.is_kept(session_id) and self._overloaded(b.rank, active, loads, cost):
            self._move(b, self._least_loaded(active, loads))
            c.rebound_overload += 1
        else:
            c.followed += 1
        b.last = now
        return b.rank

    def follow(self, session_id: str, rank: int, now: float, keep: bool = False) -> None:
        """A request of ``session_id`` went to ``rank`` by the client's own
        choice (``routed_dp_rank``): its KV is there now, so the binding
        follows."""
        self.expire(now)
        self._expired_rank.pop(session_id, None)
        b = self._lookup(session_id, keep)
        if b is None:
            self.counters.bound += 1
            self._add(session_id, rank, now, keep)
            return
        if b.rank != rank:
            self._move(b, rank)
            self.counters.rebound_explicit += 1
        b.last = now

    def _least_loaded(self, active: Sequence[int], loads: Sequence[float]) -> int:
        per_rank = self._bound_per_rank
        return min(active, key=lambda r: (loads[r], per_rank.get(r, 0), r))

    def _count(self, rank: int, delta: int) -> None:
        n = self._bound_per_rank.get(rank, 0) + delta
        if n:
            self._bound_per_rank[rank] = n
        else:
            self._bound_per_rank.pop(rank, None)

    def _move(self, b: _Binding, rank: int) -> None:
        self._count(b.rank, -1)
        self._count(rank, +1)
        b.rank = rank

    def bound_per_rank(self) -> dict:
        """Sessions bound to each rank (ranks with none are left out)."""
        return dict(self._bound_per_rank)

    def _overloaded(
        self, rank: int, active: Sequence[int], loads: Sequence[float], cost: float
    ) -> bool:
        if self.overload_factor <= 0 or len(active) < 2:
            return False
        load = loads[rank]
        if load < self.min_load:
            return False
        others = [loads[r] for r in active if r != rank]
        mean_others = sum(others) / len(others)
        return load > self.overload_factor * mean_others and load - min(others) > cost

    def close(self, session_id: str) -> bool:
        """End the binding of a closed session; ``False`` if it had none."""
        self._timeouts.pop(session_id, None)
        self._expired_rank.pop(session_id, None)
        b = (self._bindings.pop(session_id, None) or self._timed.pop(session_id, None)
             or self._kept.pop(session_id, None))
        if b is None:
            return False
        self._count(b.rank, -1)
        self.counters.closed += 1
        return True

    def expire(self, now: float) -> int:
        """Drop bindings idle for longer than their TTL (the shared one, or
        the session's own timeout; kept ones stay); returns how many."""
        n = 0
        bindings = self._bindings
        while self.ttl is not None and bindings:
            sid, b = next(iter(bindings.items()))
            if now - b.last < self.ttl:
                break
            del bindings[sid]
            self._count(b.rank, -1)
            self._remember_rank(sid, b.rank)
            n += 1
        due = self._due
        while due and due[0][0] <= now:
            at, sid = heapq.heappop(due)
            b = self._timed.get(sid)
            if b is None or b.due != at:
                continue  # the binding ended or was rescheduled
            if now - b.last < b.ttl:  # routed since: due later
                b.due = b.last + b.ttl
                heapq.heappush(due, (b.due, sid))
                continue
            del self._timed[sid]
            self._timeouts.pop(sid, None)
            self._count(b.rank, -1)
            self._remember_rank(sid, b.rank)
            n += 1
        self.counters.expired += n
        return n

    def _remember_rank(self, session_id: str, rank: int) -> None:
        hints = self._expired_rank
        hints[session_id] = rank
        hints.move_to_end(session_id)
        while len(hints) > self.max_bindings:
            hints.popitem(last=False)


__all__ = [
    "AffinityCounters",
    "DEFAULT_MAX_BINDINGS",
    "DEFAULT_OVERLOAD_FACTOR",
    "SessionAffinity",
]
