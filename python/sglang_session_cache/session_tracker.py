"""Session lifecycle for ``UnifiedRadixCache``: who is open, which generation a
request belongs to, and the per-component reference accounting behind it.

The tracker is composed into the cache (``cache.session_ref_tracker``); the
cache never inherits from it.  Sessions are soft protection: a reference only
changes eviction order, it never pins memory.

With a TTL (``--session-radix-cache-ttl``, see ``session_ttl.py``) a session
idle for at least ``ttl`` seconds is released as if closed.  Open sessions are
kept in ``last_active`` (an ``OrderedDict``, least recently active first);
activity moves a session to the end and every touch of the tracker pops the
expired ones from the front, so expiry costs O(1) when nothing expires.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Optional

from sglang_session_cache.component_refs import (
    ComponentSessionRefs,
    SessionStateError,
    make_component_refs,
)
from sglang_session_cache.session_ttl import ExpiryLog, normalize_ttl

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

# Same logger namespace as the cache, so SGLang's logging config applies.
logger = logging.getLogger("sglang.srt.mem_cache.unified_radix_cache")

CLOSED_SESSION_TOMBSTONE_LIMIT = 8192
#: Attribute stamped on a ``Req`` when it arrives for an open session.
REQ_GENERATION_ATTR = "session_ref_generation"


class SessionRefError(ValueError):
    """Bad session input (empty or non-string id).  Nothing is changed."""


def check_session_id(session_id: Any) -> str:
    if not isinstance(session_id, str):
        raise SessionRefError(
            f"session_id must be a non-empty string, got {type(session_id).__name__} "
            f"{session_id!r}"
        )
    if not session_id.strip():
        raise SessionRefError(f"session_id must be a non-empty string, got {session_id!r}")
    return session_id


def _is_aborted(req: Req) -> bool:
    reason = getattr(req, "finished_reason", None)
    return reason is not None and type(reason).__name__ == "FINISH_ABORT"


def _is_streaming(req: Req) -> bool:
    session = getattr(req, "session", None)
    return session is not None and bool(getattr(session, "streaming", False))


@dataclasses.dataclass
class SessionCounters:
    """Monotonic counters (exported through the cache's metrics path)."""

    opened: int = 0
    closed: int = 0
    registered: int = 0
    stale_rejected: int = 0
    late_finish_skipped: int = 0
    expired: int = 0  # released by the TTL (not counted in ``closed``)


@dataclasses.dataclass
class UnifiedSessionRefTracker:
    cache: Any
    tombstone_limit: int = CLOSED_SESSION_TOMBSTONE_LIMIT
    # open session id -> generation of its current incarnation
    generations: dict = dataclasses.field(default_factory=dict)
    # recently closed ids (oldest first), bounded by tombstone_limit
    closed: OrderedDict = dataclasses.field(default_factory=OrderedDict)
    # ids opened as streaming sessions; those own their KV another way
    streaming: set = dataclasses.field(default_factory=set)
    counters: SessionCounters = dataclasses.field(default_factory=SessionCounters)
    components: dict = dataclasses.field(default_factory=dict)
    relocating_components: tuple = ()
    on_ref_change: Optional[Callable] = None
    _next_generation: Any = dataclasses.field(default_factory=lambda: itertools.count(1))
    # Idle seconds after which a session is released as if closed (None: off).
    ttl: Optional[float] = None
    clock: Callable[[], float] = time.monotonic
    # open session id -> time of its last activity, least recently active first
    last_active: OrderedDict = dataclasses.field(default_factory=OrderedDict)
    # Soft-protection breaches, per component: device evictions that removed
    # referenced data, and the device tokens (Mamba: states) they freed.
    # Incremented by the cache's _evict_component_and_detach_lru hook.
    referenced_evictions: dict = dataclasses.field(default_factory=dict)
    referenced_evicted_tokens: dict = dataclasses.field(default_factory=dict)
    expiry_log: ExpiryLog = dataclasses.field(default_factory=ExpiryLog)

    def __post_init__(self):
        self.ttl = normalize_ttl(self.ttl)
        self.reset()

    def reset(self) -> None:
        """Forget everything (the tree it described is gone)."""
        self.generations.clear()
        self.last_active.clear()
        self.closed.clear()
        self.streaming.clear()
        self.components = {}
        notify = self.on_ref_change or (lambda node, ct: None)
        for ct, comp in self.cache.components.items():
            refs = make_component_refs(comp, notify)
            if refs is not None:
                self.components[ct] = refs
        # Components whose references follow their data up the tree when it is
        # evicted in place; checked on every component eviction, by identity.
        self.relocating_components = tuple(
            refs.component
            for refs in self.components.values()
            if refs.relocate_on_device_evict
        )
        # Counters are monotonic: they survive a tree reset.
        for ct in self.components:
            self.referenced_evictions.setdefault(ct, 0)
            self.referenced_evicted_tokens.setdefault(ct, 0)

    # ---- lifecycle ----

    def open_radix_session(self, session_id: str, streaming: bool = False) -> Optional[int]:
        """Open (or reopen after close) a session and return its generation.
        Reopening a closed id clears its tombstone and starts a new generation,
        so requests still in flight from the old one are rejected on finish.
        Opening an id that is already open keeps its generation."""
        sid = check_session_id(session_id)
        if streaming:
            self.streaming.add(sid)
            return None
        return self._open(sid, self._sweep())

    def _open(self, sid: str, now: float) -> int:
        gen = self.generations.get(sid)
        if gen is not None:
            self._touch(sid, now)
            return gen
        self.closed.pop(sid, None)
        gen = next(self._next_generation)
        self.generations[sid] = gen
        self.last_active[sid] = now
        self.counters.opened += 1
        logger.debug("session %s opened (generation %d)", sid, gen)
        return gen

    def ensure_session_generation(self, req: Req) -> Optional[int]:
        """Stamp a top-level ``session_id`` request with its session's current
        generation, opening the session implicitly if needed.  Requests
        without a session, streaming ones and aborted ones are left alone."""
        sid = getattr(req, "session_id", None)
        if sid is None or _is_streaming(req) or _is_aborted(req):
            return None
        existing = getattr(req, REQ_GENERATION_ATTR, None)
        if existing is not None:
            return existing
        sid = check_session_id(sid)
        if sid in self.streaming:
            return None
        # An arrival is activity: an idle-expired session is released first,
        # then reopened with a new generation.
        gen = self._open(sid, self._sweep())
        setattr(req, REQ_GENERATION_ATTR, gen)
        return gen

    def should_register(self, req: Req) -> bool:
        """Cheap pre-check used before the insert, no side effects."""
        sid = getattr(req, "session_id", None)
        return (
            isinstance(sid, str)
            and bool(sid.strip())
            and not _is_streaming(req)
            and not _is_aborted(req)
            and sid not in self.streaming
        )

    def register_session_ref(self, req: Req, leaf) -> bool:
        """Reference ``leaf`` (the node the finished request's insert ended on)
        for the request's session.  Returns whether a reference was added."""
        if not self.should_register(req):
            return False
        sid = req.session_id
        if leaf is None or leaf is self.cache.root_node or leaf.parent is None:
            return False
        now = self._sweep()
        current = self.generations.get(sid)
        gen = getattr(req, REQ_GENERATION_ATTR, None)
        if current is None:
            if sid in self.closed or gen is not None:
                # Finished after its session was closed: register nothing.
                self.counters.late_finish_skipped += 1
                logger.debug("request %s finished after session %s closed; not referenced",
                             getattr(req, "rid", "?"), sid)
                return False
            current = self._open(sid, now)
            gen = current
        if gen is None:
            gen = current
        if gen != current:
            self.counters.stale_rejected += 1
            logger.warning(
                "Session %s: request %s belongs to generation %d but the session is "
                "at generation %d (closed and reopened meanwhile); its KV stays cached "
                "but is not referenced by the session.",
                sid, getattr(req, "rid", "?"), gen, current,
            )
            return False
        for refs in self.components.values():
            refs.register_session_leaf(sid, leaf)
        self.counters.registered += 1
        self._touch(sid, now)
        return True

    def release_radix_session(self, session_id: str) -> int:
        """Close: drop every reference of the session.  KV stays cached and
        becomes ordinary unreferenced LRU data.  Idempotent; closing an id that
        was never opened is logged and remembered so late finishes register
        nothing.  Returns the number of leaf references dropped."""
        sid = check_session_id(session_id)
        self.streaming.discard(sid)
        self._sweep()
        if sid not in self.generations:
            if sid in self.closed:
                logger.debug("session %s already closed; nothing to release", sid)
            else:
                logger.warning(
                    "close_session for unknown session %r: nothing to release", sid
                )
                self._remember_closed(sid)
            return 0
        released = self._drop(sid)
        self.counters.closed += 1
        logger.debug("session %s closed: released %d leaf references", sid, released)
        return released

    def _drop(self, sid: str) -> int:
        """Release an open session (close or expiry) and tombstone its id."""
        del self.generations[sid]
        self.last_active.pop(sid, None)
        released = 0
        for refs in self.components.values():
            released += refs.release_session(sid)
        self._remember_closed(sid)
        return released

    def _remember_closed(self, sid: str) -> None:
        self.closed[sid] = None
        self.closed.move_to_end(sid)
        while len(self.closed) > self.tombstone_limit:
            self.closed.popitem(last=False)

    # ---- TTL ----

    def set_ttl(self, ttl: Any) -> Optional[float]:
        """Set (or turn off, with ``None``/0) the idle TTL in seconds.  Open
        sessions start their idle time now."""
        self.ttl = normalize_ttl(ttl)
        now = self.clock()
        for sid in self.last_active:
            self.last_active[sid] = now
        return self.ttl

    def _touch(self, sid: str, now: float) -> None:
        la = self.last_active
        if sid in la:
            la[sid] = now
            la.move_to_end(sid)

    def _sweep(self) -> float:
        """Read the clock once and expire what is due (nothing without a TTL)."""
        now = self.clock()
        if self.ttl is not None:
            self._expire_until(now - self.ttl, now)
        return now

    def _expire_until(self, deadline: float, now: float) -> int:
        # Oldest activity first: stop at the first session still within its TTL.
        la = self.last_active
        n = 0
        while la:
            sid = next(iter(la))
            last = la[sid]
            if last > deadline:
                break
            released = self._drop(sid)
            self.counters.expired += 1
            n += 1
            logger.debug(
                "session %s expired after %.1fs idle: released %d leaf references",
                sid, now - last, released,
            )
        if n:
            self.expiry_log.add(n, now, self.ttl)
        elif self.expiry_log.pending:
            self.expiry_log.flush(now, self.ttl)
        return n

    def expire_idle_sessions(self, now: Optional[float] = None) -> int:
        """Release every session idle for at least ``ttl`` seconds, as if
        closed.  Returns how many expired (0 without a TTL)."""
        if self.ttl is None:
            return 0
        if now is None:
            now = self.clock()
        return self._expire_until(now - self.ttl, now)

    def tick(self) -> None:
        """Cheap periodic hook (before eviction, on every finish, on metrics
        reads): one clock read and a look at the oldest open session."""
        if self.ttl is not None:
            self._sweep()

    # ---- tree events (called from the cache hooks) ----

    def on_split(self, new_parent, child) -> None:
        for refs in self.components.values():
            refs.on_split(new_parent, child)

    def on_node_deleted(self, node) -> None:
        for refs in self.components.values():
            refs.discard_deleted_session_leaf(node)

    def on_device_evict(self, node, ct) -> None:
        """A component's device data on ``node`` is being freed."""
        refs = self.components.get(ct)
        if refs is not None and refs.relocate_on_device_evict:
            refs.discard_deleted_session_leaf(node, node_deleted=False)

    # ---- introspection ----

    def open_sessions(self) -> list[str]:
        return list(self.generations)

    def session_leaves(self, session_id: str, ct=0) -> set:
        refs: ComponentSessionRefs = self.components[ct]
        return set(refs.leaves.get(session_id, ()))

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
        if self.last_active.keys() != self.generations.keys():
            raise SessionStateError(
                f"TTL activity index {sorted(self.last_active)} does not match the "
                f"open sessions {sorted(self.generations)}"
            )
        last = None
        for t in self.last_active.values():
            if last is not None and t < last:
                raise SessionStateError("TTL activity index is not ordered by time")
            last = t


__all__ = [
    "CLOSED_SESSION_TOMBSTONE_LIMIT",
    "REQ_GENERATION_ATTR",
    "SessionRefError",
    "SessionStateError",
    "UnifiedSessionRefTracker",
    "check_session_id",
]
