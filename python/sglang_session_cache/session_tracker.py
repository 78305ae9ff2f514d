"""Session lifecycle for ``UnifiedRadixCache``: who is open, which generation a
request belongs to, and the per-component reference accounting behind it.

The tracker is composed into the cache (``cache.session_ref_tracker``); the
cache never inherits from it.  Sessions are soft protection: a reference only
changes eviction order, it never pins memory.

With a TTL (``--session-radix-cache-ttl``, see ``session_ttl.py``) a session
with no request in flight and no arrival or finish for ``ttl`` seconds is
released as if closed.  Time is the shared clock of ``session_idle.py``: it
moves only through ``advance_clock`` (a scheduler-ordered event carrying a
value decided once for all ranks), never by reading a clock here, so every
TP/PP rank expires the same sessions at the same step.

Memory is bounded: at most ``max_open_sessions`` open sessions (the least
recently active idle one is released to make room, as if closed), tombstones
bounded in count and in id characters, streaming ids bounded in count.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Optional

from sglang_session_cache.component_refs import (
    ComponentSessionRefs,
    SessionStateError,
    index_owners,
    key_length,
    make_component_refs,
)
from sglang_session_cache.session_idle import IdleSchedule
from sglang_session_cache.protection_policy import ProtectionPolicy
from sglang_session_cache.protection_scale import ghost_key
from sglang_session_cache.session_ttl import ExpiryLog, normalize_open_timeout, normalize_ttl
from sglang_session_cache.session_ids import ENDED_IDS_KEPT, session_id_problem

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

# Same logger namespace as the cache, so SGLang's logging config applies.
logger = logging.getLogger("sglang.srt.mem_cache.unified_radix_cache")

CLOSED_SESSION_TOMBSTONE_LIMIT = ENDED_IDS_KEPT
#: Tombstones also stop at this many id characters in total (ids are not
#: length-checked on the Engine API path).
CLOSED_SESSION_TOMBSTONE_CHARS = 1 << 22
#: Open sessions kept at most; beyond, the least recently active idle one is
#: released (sessions abandoned without a TTL cannot grow state forever).
MAX_OPEN_SESSIONS = 1 << 16
#: Open session ids hold at most this many characters in total (same room-
#: making rule), so long ids cannot multiply the bound above.
MAX_OPEN_SESSION_CHARS = 1 << 24
#: Streaming session ids remembered at most (oldest forgotten first).
STREAMING_ID_LIMIT = 1 << 16
#: Attribute stamped on a ``Req`` when it arrives for an open session.
REQ_GENERATION_ATTR = "session_ref_generation"
#: Generation under which a ``Req`` is counted in flight (cleared on finish).
REQ_INFLIGHT_ATTR = "session_ref_inflight"
#: Arrival number stamped next to the generation.  Arrivals and registrations
#: share one counter, advanced only by scheduler-ordered events, so every
#: TP/PP rank computes the same numbers (no clock involved).
REQ_ARRIVAL_ATTR = "session_ref_arrival"
# Set once the learned protection scale has seen the request's match.
REQ_SCALE_SEEN_ATTR = "session_ref_scale_seen"
# The streaming session a ``Req`` is counted in flight for (cleared on finish).
REQ_STREAM_BUSY_ATTR = "session_ref_stream_busy"
#: Set on a ``Req`` whose KV is released on a failure path before SGLang marks
#: it aborted (PD transfer/bootstrap failures): it registers nothing.
REQ_ABORTING_ATTR = "session_ref_aborting"


class SessionRefError(ValueError):
    """Bad session input (an id breaking the session_ids rule).  Nothing is changed."""


def plain_session_id(session_id: Any) -> Optional[str]:
    """An exact ``str`` copy of a string id (a ``str`` subclass may override
    ``__hash__``/``__eq__``/``__repr__``/``strip``), or ``None``."""
    if isinstance(session_id, str):
        return str.__str__(session_id)
    return None


def describe_id(sid: str, limit: int = 64) -> str:
    """A log-safe rendering of a plain id (long ids shortened)."""
    if len(sid) > limit:
        return repr(sid[:limit]) + f"...({len(sid)} chars)"
    return repr(sid)


def check_session_id(session_id: Any) -> str:
    # The same rule as the HTTP edge (session_ids.py): defence in depth for
    # ids that arrive without passing it (Engine API, direct cache calls).
    sid = plain_session_id(session_id)
    problem = session_id_problem(sid if sid is not None else session_id)
    if problem is not None:
        raise SessionRefError(problem)
    return sid


def _is_aborted(req: Req) -> bool:
    if getattr(req, REQ_ABORTING_ATTR, False):
        return True
    reason = getattr(req, "finished_reason", None)
    return reason is not None and type(reason).__name__ == "FINISH_ABORT"


def _is_streaming(req: Req) -> bool:
    session = getattr(req, "session", None)
    return session is not None and bool(getattr(session, "streaming", False))


def session_id_of(req: Req) -> Any:
    """The raw session id of a request: its top-level ``session_id`` or, when
    that is absent, the id of the non-streaming ``SessionController`` session
    it was created from (``/open_session`` + ``session_params={"id": ...}``).
    Streaming sessions own their KV another way: ``None``."""
    sid = getattr(req, "session_id", None)
    if sid is not None:
        return sid
    session = getattr(req, "session", None)
    if session is None or getattr(session, "streaming", False):
        return None
    return getattr(session, "session_id", None)


@dataclasses.dataclass
class SessionCounters:
    """Monotonic counters (exported through the cache's metrics path)."""

    opened: int = 0
    closed: int = 0
    registered: int = 0
    stale_rejected: int = 0
    late_finish_skipped: int = 0
    expired: int = 0  # released by the TTL (not counted in ``closed``)
    evicted_open: int = 0  # released to stay within max_open_sessions


@dataclasses.dataclass
class UnifiedSessionRefTracker:
    cache: Any
    tombstone_limit: int = CLOSED_SESSION_TOMBSTONE_LIMIT
    tombstone_chars: int = CLOSED_SESSION_TOMBSTONE_CHARS
    max_open_sessions: int = MAX_OPEN_SESSIONS
    max_open_chars: int = MAX_OPEN_SESSION_CHARS
    streaming_limit: int = STREAMING_ID_LIMIT
    # open session id -> generation of its current incarnation
    generations: dict = dataclasses.field(default_factory=dict)
    # recently closed ids (oldest first), bounded by tombstone_limit/_chars
    closed: OrderedDict = dataclasses.field(default_factory=OrderedDict)
    # ids opened as streaming sessions (oldest first); those own their KV
    # another way
    streaming: OrderedDict = dataclasses.field(default_factory=OrderedDict)
    counters: SessionCounters = dataclasses.field(default_factory=SessionCounters)
    components: dict = dataclasses.field(default_factory=dict)
    relocating_components: tuple = ()
    # SWA reads FULL's leaf index instead of keeping its own (both reference
    # exactly the session leaves).  False keeps one index per component: the
    # layout in which a test can give one component a reference alone.
    share_leaf_index: bool = True
    # Components keeping a leaf index (set by reset()).
    index_owners: tuple = ()
    on_ref_change: Optional[Callable] = None
    _next_generation: Any = dataclasses.field(default_factory=lambda: itertools.count(1))
    # Arrivals and registrations, in scheduler order (see REQ_ARRIVAL_ATTR).
    _next_event: Any = dataclasses.field(default_factory=lambda: itertools.count(1))
    # open session id -> generation it was (freshly) opened with; in-flight
    # requests are counted under it, so an explicit re-open (new generation)
    # still sees the old generation's requests finish.
    epochs: dict = dataclasses.field(default_factory=dict)
    # Ids explicitly opened (/open_session, streaming ones too) and not closed
    # since nor expired by their own open timeout, oldest first, each with
    # that timeout (None: none): the tracker's rank-independent answer to
    # "does SGLang's session controller still hold this id" (see
    # is_explicitly_open).  Kept across global-TTL expiry, the open-session
    # bound and tree resets, which the controller never sees (a session
    # re-opened implicitly after those gets its timeout back from here);
    # bounded like the open ids.
    explicit: OrderedDict = dataclasses.field(default_factory=OrderedDict)
    # Explicit ids opened with a timeout, when SGLang's reaper ends them: that
    # long after the open or the session's last request created by SGLang's
    # session controller (``session_params``), whatever is in flight; they
    # leave ``explicit`` (and ``streaming``) then, on the shared clock.  It
    # mirrors the controller, so a tree reset and the open-session bound
    # keep it.  (The session's references follow its own idle rules in
    # ``idle``.)
    open_timeouts: IdleSchedule = dataclasses.field(default_factory=IdleSchedule)
    # Streaming id -> its requests in flight.  SGLang defers ending a
    # streaming session (timeout or close) until its request finishes, so the
    # id stays explicitly open meanwhile: ``ending`` holds such ids (True once
    # nothing is in flight: forgotten at the next tick, SGLang's next reap).
    streaming_busy: dict = dataclasses.field(default_factory=dict)
    ending: OrderedDict = dataclasses.field(default_factory=OrderedDict)
    # Idle seconds after which a session is released as if closed (None: off).
    ttl: Optional[float] = None
    # Shared clock, in-flight counts and expiry deadlines (session_idle.py).
    idle: IdleSchedule = dataclasses.field(default_factory=IdleSchedule)
    # open session id -> None, least recently active first (room-making order)
    recency: OrderedDict = dataclasses.field(default_factory=OrderedDict)
    # Soft-protection breaches, per component: [device evictions that
    # removed referenced data, the device tokens (Mamba: states) they freed].
    # Incremented by the cache's _evict_component_and_detach_lru hook and its
    # session-side _evict_device_leaf (session_eviction.py); read
    # as ``referenced_evictions`` / ``referenced_evicted_tokens``.
    breaches: dict = dataclasses.field(default_factory=dict)
    expiry_log: ExpiryLog = dataclasses.field(default_factory=ExpiryLog)
    _tombstone_chars_used: int = 0
    _open_chars_used: int = 0
    # Earned protection and the protection bound (protection_policy.py).
    policy: ProtectionPolicy = dataclasses.field(default_factory=ProtectionPolicy)

    def __post_init__(self):
        self.ttl = normalize_ttl(self.ttl)
        self.idle.set_ttl(self.ttl)
        self.reset()

    def reset(self) -> None:
        """Forget everything (the tree it described is gone)."""
        self.generations.clear()
        self._open_chars_used = 0
        self.idle.clear()
        self.recency.clear()
        self.epochs.clear()
        self.closed.clear()
        self._tombstone_chars_used = 0
        self.streaming.clear()
        self.components = {}
        notify = self.on_ref_change or (lambda node, ct: None)
        for ct, comp in self.cache.components.items():
            refs = make_component_refs(comp, notify)
            if refs is not None:
                self.components[ct] = refs
        full, swa = self.components.get(0), self.components.get(1)
        if self.share_leaf_index and full is not None and swa is not None:
            swa.follow(full)  # one leaf index for both (component_refs.follow)
        self.index_owners = index_owners(self.components)
        # Components whose references follow their data up the tree when it is
        # evicted in place; checked on every component eviction, by identity.
        self.relocating_components = tuple(
            refs.component
            for refs in self.components.values()
            if refs.relocate_on_device_evict
        )
        # Counters are monotonic: they survive a tree reset.
        for ct in self.components:
            self.breaches.setdefault(ct, [0, 0])
        self.policy.reset(self.cache, self.components)

    @property
    def referenced_evictions(self) -> dict:
        """Per component: device evictions that removed referenced data."""
        return {ct: n for ct, (n, _) in self.breaches.items()}

    @property
    def referenced_evicted_tokens(self) -> dict:
        """Per component: the device tokens (Mamba: states) those freed."""
        return {ct: n for ct, (_, n) in self.breaches.items()}

    # ---- lifecycle ----

    def open_radix_session(
        self, session_id: str, streaming: bool = False, timeout: Any = None
    ) -> Optional[int]:
        """Open a session explicitly and return its new generation.  Like
        upstream, every explicit open starts a new generation -- reopening a
        closed id clears its tombstone, re-opening an open id keeps its
        references -- so requests still in flight from the old generation
        register nothing when they finish.  ``timeout`` (``/open_session``'s)
        is this session's own idle TTL."""
        sid = check_session_id(session_id)
        # Checked before anything changes: a bad timeout opens nothing.
        own_ttl = normalize_open_timeout(timeout)
        self._hold_explicit(sid, own_ttl)
        if own_ttl is not None:
            self.open_timeouts.add(sid, own_ttl)
        else:
            self.open_timeouts.remove(sid)
        if streaming:
            self._remember_streaming(sid)
            return None
        # A regular open of an id that was streaming: it is not any more.
        self.streaming.pop(sid, None)
        gen = self._open(sid, new_generation=True)
        act = self.idle.sessions[sid]
        if act.ttl != own_ttl:  # an already open session takes the new timeout
            act.ttl = own_ttl
            self.idle.touch(sid)
        return gen

    def is_explicitly_open(self, session_id: str) -> bool:
        """Whether ``session_id`` was explicitly opened and neither closed
        since nor expired by its own ``/open_session`` timeout: then SGLang's
        session controller refuses another open of it ("already exist"), and
        the tracker must not start a new generation either.  The scheduler
        asks this instead of the controller: the controller's reaper closes
        timed-out and deferred-close sessions on each rank's own clock, so
        its answer can differ between TP/PP ranks; this one only changes with
        scheduler-ordered events and the shared clock."""
        return session_id in self.explicit

    def _hold_explicit(self, sid: str, timeout: Optional[float]) -> None:
        explicit = self.explicit
        explicit[sid] = timeout
        explicit.move_to_end(sid)
        while len(explicit) > self.max_open_sessions:
            # The oldest: a later open of it re-opens.
            self._forget_explicit(next(iter(explicit)))

    def _forget_explicit(self, sid: str) -> None:
        self.explicit.pop(sid, None)
        self.open_timeouts.remove(sid)
        self.ending.pop(sid, None)

    def _controller_ends(self, sid: str) -> None:
        """SGLang's controller ends session ``sid`` (its timeout, or a close):
        at once, or -- a streaming one with a request in flight -- once that
        request finished."""
        if sid in self.streaming and self.streaming_busy.get(sid):
            self.open_timeouts.remove(sid)
            self.ending[sid] = False
            return
        self._controller_ended(sid)

    def _controller_ended(self, sid: str) -> None:
        self.streaming.pop(sid, None)
        self._forget_explicit(sid)

    def controller_request(self, session_id: Any) -> None:
        """SGLang's session controller created a request of ``session_id``
        (``session_params``): that restarts the session's own timeout.  Called
        when the scheduler receives the request -- a request waiting for its
        grammar reaches the queue later, a retracted one again."""
        if self.open_timeouts.sessions:
            self.open_timeouts.touch(plain_session_id(session_id))

    def _open(self, sid: str, new_generation: bool = False, touch: bool = True) -> int:
        """``touch=False``: the caller records the activity itself (an
        arrival), so an already open session is not touched twice."""
        gen = self.generations.get(sid)
        if gen is not None:
            if new_generation:
                gen = self.generations[sid] = next(self._next_generation)
                logger.debug("session %s re-opened (generation %d)", describe_id(sid), gen)
            if touch:
                self.idle.touch(sid)
                self._touch(sid)
            return gen
        self._make_room(len(sid))
        self._forget_tombstone(sid)
        gen = next(self._next_generation)
        self.generations[sid] = gen
        self._open_chars_used += len(sid)
        # An explicitly opened id keeps its own timeout across a re-open
        # after a tree reset or the open-session bound released it.
        self.idle.add(sid, self.explicit.get(sid))
        self.recency[sid] = None
        self.epochs[sid] = gen
        self.policy.on_open(sid)
        self.counters.opened += 1
        logger.debug("session %s opened (generation %d)", describe_id(sid), gen)
        return gen

    def _make_room(self, new_chars: int) -> None:
        # Release the least recently active idle sessions (deterministic: the
        # order comes from scheduler events only).  Busy sessions are skipped:
        # they are bounded by the requests the scheduler holds.
        while self.generations and (
            len(self.generations) >= self.max_open_sessions
            or self._open_chars_used + new_chars > self.max_open_chars
        ):
            victim = next((s for s in self.recency if self.idle.inflight(s) == 0), None)
            if victim is None:
                return
            self._drop(victim, lapsed=True)
            self.counters.evicted_open += 1
            logger.debug("session %s released to stay within the open-session bound",
                         describe_id(victim))

    def ensure_session_generation(self, req_or_session_id: Any) -> Optional[int]:
        """The current generation of a session, opening it implicitly if needed.

        With a session id (upstream's signature) it just returns that.  With a
        ``Req`` (the scheduler's arrival hook) it also stamps the request with
        the generation and its arrival number and counts it in flight until
        its finish; the request's session is its top-level ``session_id`` or
        its non-streaming ``SessionController`` session.  Requests without a
        session, streaming ones and aborted ones are left alone (``None``)."""
        if isinstance(req_or_session_id, str):
            sid = check_session_id(req_or_session_id)
            return None if sid in self.streaming else self._open(sid)
        req = req_or_session_id
        raw = session_id_of(req)
        streaming = _is_streaming(req)
        if raw is None or streaming or _is_aborted(req):
            if (streaming and not _is_aborted(req)
                    and getattr(req, REQ_STREAM_BUSY_ATTR, None) is None):
                self._streaming_arrived(req)
            return None
        sid = self._checked_id(raw)
        if sid in self.streaming:
            return None
        existing = getattr(req, REQ_GENERATION_ATTR, None)
        if existing is not None and getattr(req, REQ_INFLIGHT_ATTR, None) is not None:
            return existing  # counted already (e.g. a retracted request requeued)
        # A fresh stamp always records the arrival below: no touch in _open.
        gen = (self._open(sid, touch=False) if existing is None
               else self.generations.get(sid))
        if existing is None:
            setattr(req, REQ_GENERATION_ATTR, gen)
            setattr(req, REQ_ARRIVAL_ATTR, next(self._next_event))
            self.policy.on_arrival(sid)
            if self.policy.withdraw_pending:
                self.policy.enforce(self.components)
        epoch = self.epochs.get(sid)
        if gen is not None and epoch is not None and getattr(req, REQ_GENERATION_ATTR) >= epoch:
            # An arrival is activity, and the session is busy until it ends.
            # (A request stamped before an explicit re-open of the same
            # incarnation, retracted and queued again, is still its own:
            # generations only grow, and the epoch is the incarnation's first.)
            setattr(req, REQ_INFLIGHT_ATTR, epoch)
            self.idle.arrive(sid)
            self._touch(sid)
        return getattr(req, REQ_GENERATION_ATTR)

    def _streaming_arrived(self, req: Req) -> None:
        sid = plain_session_id(getattr(req.session, "session_id", None))
        if sid is not None:
            self.streaming_busy[sid] = self.streaming_busy.get(sid, 0) + 1
            setattr(req, REQ_STREAM_BUSY_ATTR, sid)
            if sid in self.ending:
                # Retracted and queued again: still in flight, not ended yet.
                self.ending[sid] = False

    def _streaming_left(self, req: Req, sid: str) -> None:
        setattr(req, REQ_STREAM_BUSY_ATTR, None)
        n = self.streaming_busy.get(sid, 0) - 1
        if n > 0:
            self.streaming_busy[sid] = n
            return
        self.streaming_busy.pop(sid, None)
        if sid in self.ending:
            self.ending[sid] = True  # SGLang's next reap ends it

    def _checked_id(self, raw: Any) -> str:
        """``raw`` as a plain id.  An open id passed the check when it was
        opened, so only unknown ids are checked (every arrival would
        otherwise scan the id's characters again)."""
        if type(raw) is str and raw in self.generations:
            return raw
        return check_session_id(raw)

    def request_finished(self, req: Req) -> None:
        """The request left the scheduler (finished, aborted or retracted):
        it no longer keeps its session busy."""
        stream = getattr(req, REQ_STREAM_BUSY_ATTR, None)
        if stream is not None:
            self._streaming_left(req, stream)
        gen = getattr(req, REQ_INFLIGHT_ATTR, None)
        if gen is None:
            return
        setattr(req, REQ_INFLIGHT_ATTR, None)
        sid = plain_session_id(session_id_of(req))
        if sid is not None and self.epochs.get(sid) == gen:
            self.idle.finish(sid)
            self._touch(sid)

    # ---- the learned protection scale (protection_scale.py) ----

    def on_match(self, req: Req, key, result) -> None:
        """A scheduler match for ``req``: did it stop where unreferenced KV
        was evicted while protection held other KV?"""
        policy = self.policy
        if not policy.scale.capacity or getattr(req, REQ_SCALE_SEEN_ATTR, False):
            return
        # Once per request: the scheduler may match a queued request again.
        setattr(req, REQ_SCALE_SEEN_ATTR, True)
        node = result.last_device_node
        scale = policy.scale
        if node is None or not scale.ghosts:
            return  # the common case, decided before anything is computed
        tokens = key.token_ids
        matched = result.device_indices.shape[0]
        end = len(tokens) if key.limit is None else min(len(tokens), key.limit)
        if matched >= end:
            return
        # Most matches stop where no ghost is: one lookup decides that before
        # the session is looked up (``missed`` starts with the same lookup
        # and changes nothing when it fails).
        extra_key = key.extra_key  # LoRA / cache salt: its own subtree
        if ghost_key(node.id, tokens, scale.page, matched, extra_key) not in scale.ghosts:
            return
        sid = plain_session_id(session_id_of(req))
        returning = sid is not None and policy.turns.get(sid, 0) >= 2
        policy.on_ghost_miss(node.id, tokens, returning, self.components, matched, end,
                             extra_key)

    def on_unreferenced_evict(self, node) -> None:
        """An unreferenced FULL node's device KV is being evicted."""
        full = self.components.get(0)
        if full is None or node.parent is None:
            return
        scale = self.policy.scale
        pushed_out = full.ref_units > 0
        # With nothing referenced, a ghost still lets a returning session
        # that misses its own KV grow a scale below 1: once the bound fits no
        # session's path, nothing stays referenced, and the scale could
        # otherwise never grow back.
        if pushed_out or scale.scale < 1.0:
            mamba = self.components.get(2)
            state = mamba is None or node.component_data[2].value is not None
            key = node.key
            scale.evicted(node.parent.id, node.id, key.token_ids, key_length(key), state,
                          mamba is not None, key.extra_key, pushed_out)

    def should_register(self, req: Req) -> bool:
        """Cheap pre-check used before the insert, no side effects."""
        sid = plain_session_id(session_id_of(req))
        return (
            sid is not None
            and bool(str.strip(sid))
            and not _is_streaming(req)
            and not _is_aborted(req)
            and sid not in self.streaming
        )

    def register_session_ref(self, req: Req, leaf) -> bool:
        """Reference ``leaf`` (the node the finished request's insert ended on)
        for the request's session.  Returns whether a reference was added."""
        if not self.should_register(req):
            return False
        return self.register_checked(req, leaf)

    def register_checked(self, req: Req, leaf) -> bool:
        """``register_session_ref`` for a request ``should_register`` already
        accepted (the finish hook checks before the insert)."""
        sid = plain_session_id(session_id_of(req))
        if leaf is None or leaf is self.cache.root_node or leaf.parent is None:
            return False
        current = self.generations.get(sid)
        gen = getattr(req, REQ_GENERATION_ATTR, None)
        counted = gen is not None  # stamped on arrival: already counted
        if current is None:
            if sid in self.closed or gen is not None:
                # Finished after its session was closed: register nothing.
                self.counters.late_finish_skipped += 1
                logger.debug("request %s finished after session %s closed; not referenced",
                             getattr(req, "rid", "?"), describe_id(sid))
                return False
            current = self._open(sid)
            gen = current
        if gen is None:
            gen = current
        if gen != current:
            self.counters.stale_rejected += 1
            logger.warning(
                "Session %s: request %s belongs to generation %d but the session is "
                "at generation %d (closed and reopened meanwhile); its KV stays cached "
                "but is not referenced by the session.",
                describe_id(sid), getattr(req, "rid", "?"), gen, current,
            )
            return False
        policy = self.policy
        if not policy.earned(sid, counted):
            # Not returned yet: its KV stays ordinary LRU data.  (Counting an
            # unstamped request's arrival here may have turned first-request
            # protection off: withdraw it now, as an arrival would.)
            if policy.withdraw_pending:
                policy.enforce(self.components)
            self.idle.touch(sid)
            self._touch(sid)
            return False
        # The session's reference follows its newest turn: leaves registered
        # before this request arrived are superseded (register_session_leaf).
        stamp = next(self._next_event)
        arrived = getattr(req, REQ_ARRIVAL_ATTR, None)
        for refs in self.index_owners:
            refs.register_session_leaf(sid, leaf, stamp, arrived)
        self.counters.registered += 1
        self.idle.touch(sid)
        self._touch(sid)
        policy.on_registered(sid)
        policy.enforce(self.components)
        return True

    def release_radix_session(self, session_id: str) -> int:
        """Close: drop every reference of the session.  KV stays cached and
        becomes ordinary unreferenced LRU data.  Idempotent; closing an id that
        was never opened is logged and remembered so late finishes register
        nothing.  Returns the number of leaf references dropped."""
        sid = check_session_id(session_id)
        self._controller_ends(sid)
        if sid not in self.generations:
            self.policy.forget_lapsed(sid)  # closed after it lapsed
            if sid in self.closed:
                logger.debug("session %s already closed; nothing to release", describe_id(sid))
            else:
                # Debug, not warning: with DP ranks or workers behind a router a
                # close reaches every cache, and all but one never saw the id.
                logger.debug(
                    "close_session for unknown session %s: nothing to release",
                    describe_id(sid),
                )
                self._remember_closed(sid)
            return 0
        released = self._drop(sid)
        self.counters.closed += 1
        logger.debug("session %s closed: released %d leaf references",
                     describe_id(sid), released)
        return released

    def _drop(self, sid: str, lapsed: bool = False) -> int:
        """Release an open session (close; ``lapsed``: expiry, room) and
        tombstone its id."""
        del self.generations[sid]
        self._open_chars_used -= len(sid)
        self.idle.remove(sid)
        self.recency.pop(sid, None)
        self.epochs.pop(sid, None)
        self.policy.forget(sid, lapsed)
        released = 0
        for refs in self.index_owners:
            released += refs.release_session(sid)
        if self.policy.withdraw_pending:
            self.policy.enforce(self.components)
        self._remember_closed(sid)
        return released

    def _remember_closed(self, sid: str) -> None:
        if sid not in self.closed:
            self._tombstone_chars_used += len(sid)
        self.closed[sid] = None
        self.closed.move_to_end(sid)
        while self.closed and (
            len(self.closed) > self.tombstone_limit
            or self._tombstone_chars_used > self.tombstone_chars
        ):
            old, _ = self.closed.popitem(last=False)
            self._tombstone_chars_used -= len(old)

    def _forget_tombstone(self, sid: str) -> None:
        if self.closed.pop(sid, 0) is None:
            self._tombstone_chars_used -= len(sid)

    def _remember_streaming(self, sid: str) -> None:
        self.streaming[sid] = None
        self.streaming.move_to_end(sid)
        while len(self.streaming) > self.streaming_limit:
            self.streaming.popitem(last=False)

    def _touch(self, sid: str) -> None:
        if sid in self.recency:
            self.recency.move_to_end(sid)

    # ---- protection policy ----

    def configure_protection(
        self, max_protected_fraction: Any = None, protect_from_turn: Any = None
    ) -> None:
        """Set the protection bound (share of each pool) and the request from
        which a session is protected (``None``: the defaults); withdraws at
        once if the new bound is already exceeded."""
        policy = self.policy
        policy.configure(max_protected_fraction, protect_from_turn)
        policy.set_fraction(policy.max_protected_fraction, self.components, self.cache)
        policy.enforce(self.components)

    def enforce_protection_bound(self) -> int:
        """Before eviction: a reference that moved up from an evicted SWA leaf
        can widen its window between registrations.  One comparison per
        component when within bound.  Returns sessions withdrawn."""
        return self.policy.enforce(self.components)

    # ---- TTL (shared clock) ----

    def set_ttl(self, ttl: Any) -> Optional[float]:
        """Set (or turn off, with ``None``/0) the idle TTL in seconds.  Open
        sessions start their idle time at the current shared clock."""
        self.ttl = normalize_ttl(ttl)
        self.idle.set_ttl(self.ttl)
        return self.ttl

    @property
    def now(self) -> float:
        """The shared clock: the last value ``advance_clock`` delivered."""
        return self.idle.now

    def advance_clock(self, t: float) -> int:
        """Deliver a shared-clock value (a scheduler-ordered event, identical
        on every rank) and release the sessions now due, as if closed.
        Returns how many expired."""
        if self.ending:
            for sid in [s for s, ready in self.ending.items() if ready]:
                self._controller_ended(sid)
        for sid in self.open_timeouts.advance(t):
            # Its own /open_session timeout: SGLang's reaper ends the
            # controller's session (its references follow their idle rules).
            self._controller_ends(sid)
        due = self.idle.advance(t)
        for sid in due:
            act = self.idle.sessions.get(sid)
            if act is not None and act.ttl is not None:
                # Its own /open_session timeout: SGLang's reaper ended the
                # controller's session by now (on its own clock).
                self._forget_explicit(sid)
            released = self._drop(sid, lapsed=True)
            self.counters.expired += 1
            logger.debug("session %s expired: released %d leaf references",
                         describe_id(sid), released)
        if due:
            self.expiry_log.add(len(due), self.idle.now, self.ttl)
        elif self.expiry_log.pending:
            self.expiry_log.flush(self.idle.now, self.ttl)
        return len(due)

    def expire_idle_sessions(self, now: Optional[float] = None) -> int:
        """Release every session due at the shared clock (moved to ``now``
        first when given).  Returns how many expired."""
        return self.advance_clock(self.idle.now if now is None else now)

    # ---- tree events (called from the cache hooks) ----

    def on_split(self, new_parent, child) -> None:
        for refs in self.components.values():
            refs.on_split(new_parent, child)
            refs.account_split(new_parent, child)

    def on_node_deleted(self, node) -> None:
        cds = node.component_data
        parent = None  # looked up once, for every component with references
        for refs in self.index_owners:
            sids = cds[refs.ct].session_leaf_of
            if not sids:  # only session leaves move
                continue
            if parent is None:
                # The parent every component hands its references to
                # together, or False for the general route (children left,
                # the root, or a parent without KV).  Structural, so looked
                # up once; with the key's length (``key_length``, inlined:
                # every deleted session leaf comes here).
                parent = node.parent
                if node.children or parent is None or parent is self.cache.root_node:
                    parent = False
                else:
                    pcd = parent.component_data[0]
                    if pcd.value is None and pcd.host_value is None:
                        parent = False
                    else:
                        key = node.key
                        if key.limit is None and not key.is_bigram:
                            length = len(key.token_ids)
                        else:
                            length = len(key)
            if parent:
                refs.hand_over_deleted(node, parent, sids, length)
            else:
                refs.discard_deleted_session_leaf(node)

    def on_device_evict(self, node, ct) -> None:
        """A component's device data on ``node`` is being freed."""
        self.on_component_evict(node, ct, device=True)

    def on_component_evict(self, node, ct, device: bool) -> None:
        """One layer (device, or host with ``device=False``) of a relocating
        component's data on ``node`` is being freed in place.  The reference
        stays while the other layer still holds the state (a leaf demoted to
        host memory keeps its Mamba reference and can be loaded back); it
        moves to the nearest ancestor with a state once neither does."""
        refs = self.components.get(ct)
        if refs is None or not refs.relocate_on_device_evict:
            return
        cd = node.component_data[ct]
        evicted, other = (cd.value, cd.host_value) if device else (cd.host_value, cd.value)
        if evicted is None or other is not None:
            return
        refs.discard_deleted_session_leaf(node, node_deleted=False)

    # ---- introspection ----

    def open_sessions(self) -> list[str]:
        return list(self.generations)

    def session_leaves(self, session_id: str, ct=0) -> set:
        refs: ComponentSessionRefs = self.components[ct]
        return set(refs.leaves_of(session_id))

    def validate_session_state(self, nodes: Optional[list] = None) -> None:
        """Recompute every count from the leaf indices; raise
        ``SessionStateError`` on the first mismatch."""
        if nodes is None:
            nodes = self.cache._collect_all_nodes()
        for refs in self.components.values():
            refs.validate(nodes)
        for refs in self.components.values():
            for sid in refs.leaves:
                if sid not in self.generations:
                    raise SessionStateError(
                        f"[{refs.ct}] closed or unknown session {sid!r} still holds leaves"
                    )
        open_ids = self.generations.keys()
        if len(self.explicit) > self.max_open_sessions:
            raise SessionStateError("explicitly opened ids exceed the open-session bound")
        if self.idle.sessions.keys() != open_ids or self.recency.keys() != open_ids:
            raise SessionStateError(
                f"TTL activity index {sorted(self.idle.sessions)} / recency "
                f"{sorted(self.recency)} does not match the open sessions {sorted(open_ids)}"
            )
        if self.idle.heap_size() > 2 * len(open_ids) + 64:
            raise SessionStateError("TTL deadline heap is not bounded by the open sessions")
        timed = self.open_timeouts.sessions
        if not timed.keys() <= self.explicit.keys():
            raise SessionStateError(
                f"open timeouts {sorted(timed.keys() - self.explicit.keys())} "
                "are kept for ids no longer explicitly open"
            )
        if self.open_timeouts.heap_size() > 2 * len(timed) + 64:
            raise SessionStateError("open timeout heap is not bounded by its ids")
        if not self.ending.keys() <= self.explicit.keys():
            raise SessionStateError(
                f"ending sessions {sorted(self.ending.keys() - self.explicit.keys())} "
                "are no longer explicitly open"
            )
        problem = self.policy.validate(self.components, self.generations)
        if problem is not None:
            raise SessionStateError(f"protection policy: {problem}")


__all__ = [
    "CLOSED_SESSION_TOMBSTONE_CHARS",
    "CLOSED_SESSION_TOMBSTONE_LIMIT",
    "MAX_OPEN_SESSIONS",
    "MAX_OPEN_SESSION_CHARS",
    "REQ_ABORTING_ATTR",
    "REQ_INFLIGHT_ATTR",
    "REQ_STREAM_BUSY_ATTR",
    "STREAMING_ID_LIMIT",
    "describe_id",
    "plain_session_id",
    "session_id_of",
    "REQ_ARRIVAL_ATTR",
    "REQ_GENERATION_ATTR",
    "SessionRefError",
    "SessionStateError",
    "UnifiedSessionRefTracker",
    "check_session_id",
]
