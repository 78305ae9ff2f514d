"""How a client tags and closes sessions, applied to any trace (generated,
JSONL or Mooncake) before it is replayed.

Real clients differ: some tag only real multi-turn sessions and close them,
others send a conversation id on every call and never close anything. The
same trace can be replayed under each policy:

``--close``
    ``auto``: as the trace says (JSONL: its close fields and close lines;
    generator: closed after the last turn, abandoned sessions never;
    Mooncake: after each session's last turn). ``last-turn``: every session
    is closed right after its last request. ``never``: every close is dropped
    (with ``--session-radix-cache-ttl`` the TTL is then the only way a
    session's references end).
``--tag``
    ``sessions``: as the trace says. ``all``: every one-shot request gets a
    session id of its own (``oneshot-<n>``), never closed, as when a client
    sends a conversation id on every call.

``MODES`` names the combinations the session-protection work measures; a
mode is just a (tag, close, ttl) preset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sglang_session_cache_bench.trace import Trace, TraceClose, TraceRequest

TAG_CHOICES = ("sessions", "all")
CLOSE_CHOICES = ("auto", "last-turn", "never")
ONESHOT_SESSION_PREFIX = "oneshot-"
#: TTL a ``*-ttl`` mode uses unless ``--session-radix-cache-ttl`` is given.
DEFAULT_MODE_TTL = 60.0


@dataclass(frozen=True)
class Mode:
    name: str
    tag: str
    close: str
    ttl: bool  # needs an idle TTL
    about: str


MODES = {
    m.name: m
    for m in (
        Mode("closed", "sessions", "auto", False,
             "multi-turn sessions tagged and closed after their last turn"),
        Mode("never-closed", "sessions", "never", False,
             "multi-turn sessions tagged, never closed"),
        Mode("ttl", "sessions", "never", True,
             "multi-turn sessions tagged, ended only by the idle TTL"),
        Mode("tag-all", "all", "never", False,
             "every request tagged (one-shots with an id of their own), nothing closed"),
        Mode("tag-all-ttl", "all", "never", True,
             "every request tagged, nothing closed, ended only by the idle TTL"),
    )
}


def apply_policy(trace: Trace, tag: str = "sessions", close: str = "auto") -> Trace:
    """A new ``Trace`` with the tagging/closing policy applied (the input is
    not changed; prompts and outputs are shared, not copied)."""
    if tag not in TAG_CHOICES:
        raise ValueError(f"tag must be one of {TAG_CHOICES}, got {tag!r}")
    if close not in CLOSE_CHOICES:
        raise ValueError(f"close must be one of {CLOSE_CHOICES}, got {close!r}")
    if tag == "sessions" and close == "auto":
        return trace
    events = [_copy(ev) for ev in trace.events]
    if close == "never":
        events = [e for e in events if isinstance(e, TraceRequest)]
        for e in events:
            e.close = False
    elif close == "last-turn":
        _close_after_last_turn(events)
    if tag == "all":
        _tag_oneshots(events)
    params = dict(trace.params, tag=tag, close=close)
    return Trace(events, source=trace.source, params=params)


def _copy(ev):
    if isinstance(ev, TraceClose):
        return TraceClose(ev.session_id, line=ev.line, time=ev.time)
    return TraceRequest(ev.prompt, ev.output, session_id=ev.session_id, close=ev.close,
                        turn=ev.turn, line=ev.line, time=ev.time,
                        tagged_oneshot=ev.tagged_oneshot)


def _close_after_last_turn(events: list) -> None:
    # A session whose last request is already followed by a close keeps it.
    last: dict = {}
    for i, e in enumerate(events):
        sid = e.session_id
        if isinstance(e, TraceRequest):
            if sid is not None:
                last[sid] = None if e.close else i
        else:
            last[sid] = None
    for i in last.values():
        if i is not None:
            events[i].close = True


def _tag_oneshots(events: list) -> None:
    taken = {e.session_id for e in events if e.session_id is not None}
    n = 0
    for e in events:
        if isinstance(e, TraceRequest) and e.session_id is None:
            sid = f"{ONESHOT_SESSION_PREFIX}{n}"
            while sid in taken:
                n += 1
                sid = f"{ONESHOT_SESSION_PREFIX}{n}"
            e.session_id, e.turn, e.close, e.tagged_oneshot = sid, 1, False, True
            n += 1


def mode_ttl(mode: Mode, ttl: Optional[float]) -> Optional[float]:
    """The TTL a mode replays with: none for a mode without one, else the
    given TTL or ``DEFAULT_MODE_TTL``."""
    if not mode.ttl:
        return None
    return ttl if ttl is not None else DEFAULT_MODE_TTL


__all__ = [
    "CLOSE_CHOICES",
    "DEFAULT_MODE_TTL",
    "MODES",
    "Mode",
    "ONESHOT_SESSION_PREFIX",
    "TAG_CHOICES",
    "apply_policy",
    "mode_ttl",
]
