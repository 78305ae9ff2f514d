"""How often sessions come back: what ``--session-radix-cache-protect-from-turn
auto`` learns from.

A session *starts* with its first request.  It is resolved as **returned**
when its second request arrives, and as **not returned** when it is closed,
expires or is released with one request, or when ``horizon`` newer sessions
have started meanwhile (a conversation that never returns gives no other
signal).  A session that returns after being counted as not returned is
counted again as returned.  The return rate is the share of returned sessions
among the resolved ones, exponentially weighted over about ``window``
resolutions, starting from ``prior`` pseudo-sessions that returned (so a new
server protects first turns until it has seen traffic that does not return).

``protect_first`` is the decision: on while the rate is at least ``on_at``,
off once it falls below ``off_below`` (the gap keeps it from flapping on
traffic near the threshold).  Clients that tag only real multi-turn sessions
keep it on: their first turns are protected at once, as with ``1``.  Clients
that tag every call (most conversations single-shot) turn it off: only
sessions that have returned are protected, as with ``2``.

Everything is counted in scheduler event order (arrivals, closes), never a
clock, so every TP/PP rank that sees the same requests decides the same.
Each event is O(1): one ordered-dict operation plus amortized age-outs (each
start is aged out at most once).
"""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_HORIZON = 64
DEFAULT_WINDOW = 256
DEFAULT_PRIOR = 2.0
DEFAULT_ON_AT = 0.5
DEFAULT_OFF_BELOW = 0.4


class SessionReturnRate:
    def __init__(
        self,
        horizon: int = DEFAULT_HORIZON,
        window: int = DEFAULT_WINDOW,
        prior: float = DEFAULT_PRIOR,
        on_at: float = DEFAULT_ON_AT,
        off_below: float = DEFAULT_OFF_BELOW,
    ):
        self.horizon = horizon
        self.decay = 1.0 - 1.0 / window
        self.prior = prior
        self.on_at = on_at
        self.off_below = off_below
        self.reset()

    def reset(self) -> None:
        # started, not yet resolved: sid -> start number (oldest first)
        self.pending: OrderedDict = OrderedDict()
        # resolved as not returned by age only (a late return corrects it);
        # bounded like ``pending``
        self.aged_out: OrderedDict = OrderedDict()
        self.starts = 0
        self.returned_weight = 0.0
        self.resolved_weight = 0.0
        self.protect_first = True
        self.turned_off = 0  # times protect_first went from on to off

    def forget_sessions(self) -> None:
        """Every session was dropped at once (a cache reset): what was
        learned about the traffic stays, the unresolved sessions go."""
        self.pending.clear()
        self.aged_out.clear()

    @property
    def rate(self) -> float:
        return (self.returned_weight + self.prior) / (self.resolved_weight + self.prior)

    # ---- events; each returns True when protect_first just turned off ----

    def started(self, sid: str) -> bool:
        self.starts += 1
        self.aged_out.pop(sid, None)
        self.pending[sid] = self.starts
        self.pending.move_to_end(sid)
        flipped = False
        oldest_kept = self.starts - self.horizon
        pending = self.pending
        while pending:
            old_sid, n = next(iter(pending.items()))
            if n > oldest_kept:
                break
            del pending[old_sid]
            self.aged_out[old_sid] = None
            if len(self.aged_out) > self.horizon:
                self.aged_out.popitem(last=False)
            flipped |= self._resolve(False)
        return flipped

    def returned(self, sid: str) -> bool:
        if self.pending.pop(sid, None) is not None:
            return self._resolve(True)
        if sid in self.aged_out:
            del self.aged_out[sid]
            # Counted as not returned too early: count the return after all.
            self.returned_weight = min(self.resolved_weight, self.returned_weight + 1.0)
            return self._update()
        return False

    def ended(self, sid: str) -> bool:
        """The session was closed, expired or released."""
        self.aged_out.pop(sid, None)
        if self.pending.pop(sid, None) is not None:
            return self._resolve(False)
        return False

    def _resolve(self, returned: bool) -> bool:
        d = self.decay
        self.returned_weight = self.returned_weight * d + (1.0 if returned else 0.0)
        self.resolved_weight = self.resolved_weight * d + 1.0
        return self._update()

    def _update(self) -> bool:
        rate = self.rate
        if self.protect_first and rate < self.off_below:
            self.protect_first = False
            self.turned_off += 1
            return True
        if not self.protect_first and rate >= self.on_at:
            self.protect_first = True
        return False

    def validate(self) -> str | None:
        if len(self.pending) > self.horizon:
            return f"{len(self.pending)} pending session starts exceed the horizon {self.horizon}"
        if not 0.0 <= self.returned_weight <= self.resolved_weight + 1e-9:
            return (f"returned weight {self.returned_weight} outside "
                    f"[0, resolved {self.resolved_weight}]")
        return None


__all__ = ["SessionReturnRate"]
