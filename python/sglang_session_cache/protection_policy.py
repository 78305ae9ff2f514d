"""Which sessions' KV is protected, and how much protection there may be.

Two rules keep session protection from hurting when clients tag every
conversation (most of which never return):

* **Earned protection** (``--session-radix-cache-protect-from-turn``,
  default ``auto``): a session's finished requests register references only
  from its N-th request on, so a single-shot conversation never displaces
  other KV; once a conversation shows it returns, its newest turn is
  referenced as before (covering the whole conversation).  ``1`` protects
  from the first request (the behaviour before this option), ``2`` from the
  second.  ``auto`` learns which of the two fits the traffic
  (``session_return_rate.py``): while most recent sessions came back for a
  second request, first requests are protected too; when most did not (a
  client that tags every call), only returning sessions are, and the
  sessions protected on their first request alone lose that protection at
  once.  Requests are counted per session generation, on arrival at the
  scheduler (or on finish for a request that was never stamped).

* **A bound** (``--session-radix-cache-max-protected-fraction F|auto``,
  default ``auto``): for every component whose pool size is known, the
  referenced data (FULL/SWA tokens, Mamba states; distinct nodes, counted
  incrementally by ``ComponentSessionRefs.ref_units``) may hold at most ``F``
  of the pool.  ``auto`` is 0.9 times a scale learned from the misses
  protection causes (``protection_scale.py``: misses on unreferenced KV that
  protection pushed out shrink it; returning sessions that miss their own
  unprotected KV grow it).  Past the
  bound, protection is **withdrawn** until every component is within bound:
  first from sessions protected on their first request alone (they have not
  shown they return), then from the session whose last registration is the
  oldest (least recently active).  A withdrawn session stays open (TTL and
  close work as before); its KV stays cached as ordinary LRU data, and its
  next finished request registers again.

Why least recently active: a session that has not come back for the longest
time is the least likely to come back soon (agent and chat turn gaps are
short relative to abandonment), and it is the order the plain LRU would
evict its KV in anyway -- withdrawing it only lets LRU do that.  Withdrawal
order is event order (registrations), never a clock, so every TP/PP rank that
sees the same requests withdraws the same sessions.

Cost: a registration moves its session to the end of an ``OrderedDict``
(O(1)); the bound check reads one counter per component; each withdrawal pops
the front (O(1)) and releases that session's references, paid for by the
registrations that created them (amortized O(1) per reference).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Optional

from sglang_session_cache.component_refs import index_owners
from sglang_session_cache.protection_scale import ProtectionScale
from sglang_session_cache.session_ids import ENDED_IDS_KEPT
from sglang_session_cache.session_return_rate import SessionReturnRate

#: ``ServerArgs`` attributes (and ``sglang.Engine`` keywords) and CLI flags.
FRACTION_FIELD = "session_radix_cache_max_protected_fraction"
FRACTION_FLAG = "--session-radix-cache-max-protected-fraction"
FROM_TURN_FIELD = "session_radix_cache_protect_from_turn"
FROM_TURN_FLAG = "--session-radix-cache-protect-from-turn"

#: ``--session-radix-cache-protect-from-turn auto``: 1 or 2, learned;
#: ``--session-radix-cache-max-protected-fraction auto``: up to
#: ``AUTO_FRACTION_CEILING``, scaled by what protection costs (learned).
AUTO = "auto"
AUTO_FRACTION_CEILING = 0.9
#: Request counts kept for sessions that lapsed without a close (TTL, the
#: open-session bound), oldest dropped first.
LAPSED_LIMIT = ENDED_IDS_KEPT
DEFAULT_MAX_PROTECTED_FRACTION = AUTO
DEFAULT_PROTECT_FROM_TURN = AUTO


class ProtectionOptionError(ValueError):
    """Invalid protection option value."""


def normalize_fraction(value: Any):
    """``None`` -> the default; ``"auto"`` -> ``AUTO``; a number in (0, 1] ->
    float; else raise."""
    if value is None:
        return DEFAULT_MAX_PROTECTED_FRACTION
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    if isinstance(value, bool):
        raise ProtectionOptionError(f"{FRACTION_FLAG} must be a number, got {value!r}")
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ProtectionOptionError(
            f"{FRACTION_FLAG} must be 'auto' or a number in (0, 1], got {value!r}"
        ) from None
    if math.isnan(f) or not 0.0 < f <= 1.0:
        raise ProtectionOptionError(
            f"{FRACTION_FLAG} must be 'auto' or a number in (0, 1], got {value!r}"
        )
    return f


def normalize_from_turn(value: Any):
    """``None`` -> the default; ``"auto"`` -> ``AUTO``; an integer >= 1 ->
    int; else raise."""
    if value is None:
        return DEFAULT_PROTECT_FROM_TURN
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    if isinstance(value, bool):
        raise ProtectionOptionError(f"{FROM_TURN_FLAG} must be an integer, got {value!r}")
    try:
        n = int(value)
        if n != float(value):
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise ProtectionOptionError(
            f"{FROM_TURN_FLAG} must be 'auto' or an integer >= 1, got {value!r}"
        ) from None
    if n < 1:
        raise ProtectionOptionError(
            f"{FROM_TURN_FLAG} must be 'auto' or an integer >= 1, got {value!r}")
    return n


def configured_options(server_args: Any) -> tuple:
    """``(max_protected_fraction, protect_from_turn)`` of a ``ServerArgs``
    (defaults when absent)."""
    return (
        normalize_fraction(getattr(server_args, FRACTION_FIELD, None)),
        normalize_from_turn(getattr(server_args, FROM_TURN_FIELD, None)),
    )


def published_options() -> tuple:
    """The options of the process-wide ``ServerArgs``; defaults when none is
    published (a cache built outside a server)."""
    from sglang.srt.runtime_context import get_server_args

    try:
        server_args = get_server_args()
    except ValueError:  # "Global server args is not set yet!"
        server_args = None
    return configured_options(server_args)


def component_capacity(cache, ct: int) -> Optional[int]:
    """Pool size of component ``ct`` in its ``ref_units`` (tokens; Mamba:
    states), or ``None`` when this cache does not expose it."""
    ct = int(ct)
    if ct == 2:
        pool = getattr(cache, "req_to_token_pool", None)
        alloc = getattr(pool, "mamba_allocator", None)
    else:
        alloc = getattr(cache, "token_to_kv_pool_allocator", None)
        if alloc is not None:
            name = "full_attn_allocator" if ct == 0 else "swa_attn_allocator"
            alloc = getattr(alloc, name, alloc if ct == 0 else None)
    size = getattr(alloc, "size", None)
    return size if isinstance(size, int) and size > 0 else None


class ProtectionPolicy:
    """Earned protection and the protection bound for one tracker (see the
    module doc).  The tracker calls ``on_open``/``on_arrival``/``earned``/
    ``on_registered``/``forget``; ``enforce`` withdraws past the bound (and,
    under ``auto``, the first-request protection the traffic stopped earning;
    ``withdraw_pending`` says it is due)."""

    def __init__(
        self,
        max_protected_fraction: Any = None,
        protect_from_turn: Any = None,
    ):
        self.max_protected_fraction = normalize_fraction(max_protected_fraction)
        self.protect_from_turn = normalize_from_turn(protect_from_turn)
        # open session id -> requests seen in its current generation
        self.turns: dict = {}
        # sessions that lapsed (TTL, open-session bound) without a close ->
        # their request count, oldest first, at most ``LAPSED_LIMIT``
        self.lapsed: OrderedDict = OrderedDict()
        # sessions that registered references, least recently registered first
        self.protected: OrderedDict = OrderedDict()
        # (auto) the protected sessions registered on their first request only
        self.first_turn_only: OrderedDict = OrderedDict()
        self.return_rate = SessionReturnRate()
        self.withdraw_pending = False
        # learned scale on the fraction (protection_scale.py)
        self.scale = ProtectionScale()
        # component type -> pool size in ref_units (None: unknown)
        self.capacity: dict = {}
        # component type -> most ref_units it may hold (None: unbounded)
        self.limits: dict = {}
        # monotonic counters (survive a reset)
        self.withdrawals = 0  # sessions whose protection was withdrawn
        self.withdrawn_refs = 0  # leaf references dropped by withdrawals
        self.unearned_finishes = 0  # finishes not referenced (not earned yet)
        self.first_turn_withdrawals = 0  # (auto) withdrawn when the rate fell

    @property
    def auto(self) -> bool:
        return self.protect_from_turn == AUTO

    @property
    def protects_first_turn(self) -> bool:
        """Whether a session's first request is protected right now."""
        if self.auto:
            return self.return_rate.protect_first
        return self.protect_from_turn <= 1

    def configure(self, max_protected_fraction: Any, protect_from_turn: Any) -> None:
        self.max_protected_fraction = normalize_fraction(max_protected_fraction)
        self.protect_from_turn = normalize_from_turn(protect_from_turn)
        if not self.auto:
            self.first_turn_only.clear()

    def reset(self, cache, components: dict) -> None:
        """Forget per-session state; recompute the per-component limits.  The
        learned return rate describes the traffic, not the cache: it stays."""
        self.turns.clear()
        self.lapsed.clear()
        self.protected.clear()
        self.first_turn_only.clear()
        self.return_rate.forget_sessions()
        self.withdraw_pending = False
        self.scale.forget()
        self.set_fraction(self.max_protected_fraction, components, cache)

    def set_fraction(self, fraction: Any, components: dict, cache) -> None:
        self.max_protected_fraction = normalize_fraction(fraction)
        self.capacity = {ct: component_capacity(cache, ct) for ct in components}
        self.scale.page = max(1, int(getattr(cache, "page_size", 1) or 1))
        if self.max_protected_fraction == AUTO:
            self.scale.configure(self.capacity.get(0))
        else:  # a fixed fraction: nothing learned, no ghosts kept
            self.scale.configure(None)
            self.scale.scale = 1.0
        self._apply_limits()

    @property
    def effective_fraction(self) -> float:
        """The share of each pool references may hold now: a fixed fraction,
        or under ``auto`` the ceiling times the learned scale."""
        f = self.max_protected_fraction
        if f == AUTO:
            return AUTO_FRACTION_CEILING * self.scale.scale
        return f

    def _apply_limits(self) -> None:
        f = self.effective_fraction
        self.limits = {
            ct: None if cap is None else int(cap * f) for ct, cap in self.capacity.items()
        }

    # ---- the learned scale ----

    def on_ghost_miss(self, parent_id: int, tokens, returning: bool,
                      components: dict, start: int = 0, end: Optional[int] = None,
                      extra_key=None) -> None:
        """A request's match of ``tokens[start:end]`` (in namespace
        ``extra_key``) stopped where unreferenced KV was evicted."""
        scale = self.scale
        old = scale.scale
        shrank = scale.missed(parent_id, tokens, returning, start, end, extra_key)
        if scale.scale != old:
            self._apply_limits()
            if shrank:
                self.enforce(components)

    # ---- turns (earned protection) ----

    def on_open(self, sid: str) -> None:
        # A session that lapsed and comes back with the same id goes on with
        # its request count: its return is a returning session's, not a
        # first request (else its misses on its own evicted KV read as
        # traffic that protection pushed out).
        self.turns[sid] = self.lapsed.pop(sid, 0)

    def on_arrival(self, sid: str) -> None:
        n = self.turns[sid] = self.turns.get(sid, 0) + 1
        if n > 2 or not self.auto:
            return
        if n == 1:
            flipped = self.return_rate.started(sid)
        else:
            self.first_turn_only.pop(sid, None)  # it returned: earned for good
            flipped = self.return_rate.returned(sid)
        if flipped:
            self.withdraw_pending = True

    def earned(self, sid: str, counted: bool) -> bool:
        """Whether a finishing request of ``sid`` may register.  ``counted``:
        its arrival was already counted (the request was stamped)."""
        if not counted:
            self.on_arrival(sid)
        turns = self.turns.get(sid, 0)
        if self.auto:
            if turns >= 2 or (turns == 1 and self.return_rate.protect_first):
                return True
        elif turns >= self.protect_from_turn:
            return True
        self.unearned_finishes += 1
        return False

    # ---- protected order (bound) ----

    def on_registered(self, sid: str) -> None:
        protected = self.protected
        if sid in protected:
            protected.move_to_end(sid)
        else:
            protected[sid] = None
        if self.auto and self.turns.get(sid, 0) < 2:
            self.first_turn_only[sid] = None

    def forget_lapsed(self, sid: str) -> None:
        """A lapsed session was closed: the conversation is over, so a later
        request with this id starts from its first request again."""
        self.lapsed.pop(sid, None)

    def forget(self, sid: str, lapsed: bool = False) -> None:
        """The session was closed, or (``lapsed``) expired by the TTL or
        released to stay within the open-session bound: a client that did
        not close it may still come back, so its request count is kept."""
        turns = self.turns.pop(sid, None)
        if lapsed and turns:
            self.lapsed[sid] = turns
            self.lapsed.move_to_end(sid)
            if len(self.lapsed) > LAPSED_LIMIT:
                self.lapsed.popitem(last=False)
        self.protected.pop(sid, None)
        self.first_turn_only.pop(sid, None)
        if self.auto and self.return_rate.ended(sid):
            self.withdraw_pending = True

    def over_bound(self, components: dict) -> bool:
        limits = self.limits
        for ct, refs in components.items():
            limit = limits.get(ct)
            if limit is not None and refs.ref_units > limit:
                return True
        return False

    def _withdraw(self, sid: str, components: dict) -> None:
        self.protected.pop(sid, None)
        for refs in index_owners(components):
            self.withdrawn_refs += refs.release_session(sid)

    def enforce(self, components: dict) -> int:
        """Withdraw what is due: under ``auto``, every first-request-only
        protection once the return rate fell; then, until every component is
        within its limit, first-request-only sessions and then the least
        recently registered ones.  Returns sessions withdrawn."""
        n = 0
        first_only = self.first_turn_only
        if self.withdraw_pending:
            self.withdraw_pending = False
            while first_only:
                sid, _ = first_only.popitem(last=False)
                self._withdraw(sid, components)
                self.first_turn_withdrawals += 1
                n += 1
        protected = self.protected
        while protected and self.over_bound(components):
            if first_only:
                sid, _ = first_only.popitem(last=False)
            else:
                sid, _ = protected.popitem(last=False)
            self._withdraw(sid, components)
            n += 1
        self.withdrawals += n
        return n

    def validate(self, components: dict, open_sessions) -> Optional[str]:
        """First inconsistency with the tracker's state, or ``None``."""
        for sid in self.protected:
            if sid not in open_sessions:
                return f"protected session {sid!r} is not open"
        if self.turns.keys() - open_sessions.keys():
            return f"turn counts kept for closed sessions {sorted(self.turns.keys() - open_sessions.keys())}"
        if self.lapsed.keys() & open_sessions.keys():
            return f"lapsed turn counts kept for open sessions {sorted(self.lapsed.keys() & open_sessions.keys())}"
        if len(self.lapsed) > LAPSED_LIMIT:
            return f"{len(self.lapsed)} lapsed turn counts kept (at most {LAPSED_LIMIT})"
        for sid in self.first_turn_only:
            if sid not in self.protected:
                return f"first-request-only session {sid!r} is not protected"
            if self.turns.get(sid, 0) >= 2:
                return f"session {sid!r} returned but is still marked first-request-only"
        if self.first_turn_only and not (self.auto and not self.withdraw_pending
                                         and self.return_rate.protect_first):
            return "first-request-only protection kept while first requests are not protected"
        problem = self.return_rate.validate()
        if problem:
            return f"return rate: {problem}"
        problem = self.scale.validate()
        if problem:
            return f"protection scale: {problem}"
        # The bound itself is not an invariant between events: a reference
        # moving up from an evicted SWA leaf can widen its window.  It holds
        # after every registration and before every eviction (``tick``).
        return None


__all__ = [
    "AUTO",
    "AUTO_FRACTION_CEILING",
    "DEFAULT_MAX_PROTECTED_FRACTION",
    "DEFAULT_PROTECT_FROM_TURN",
    "FRACTION_FIELD",
    "FRACTION_FLAG",
    "FROM_TURN_FIELD",
    "FROM_TURN_FLAG",
    "ProtectionOptionError",
    "ProtectionPolicy",
    "component_capacity",
    "configured_options",
    "normalize_fraction",
    "normalize_from_turn",
    "published_options",
]
