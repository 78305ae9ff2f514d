"""Session TTL: release the references of sessions that went idle.

Agents that never call ``/close_session`` would otherwise keep their KV in the
referenced partition for the life of the server.  With
``--session-radix-cache-ttl SECONDS`` a session with no request in flight and
no arrival or finish for the TTL is released exactly as if it had been closed:
its references are dropped (the KV stays cached as ordinary LRU data), its id
is tombstoned so late finishes register nothing, and a new request with that
id reopens it with a new generation.

Time is a shared clock delivered in scheduler order (``session_idle.py``,
``patches/session_clock.py``), identical on every TP/PP rank; nothing here or
in the tracker reads a rank's own clock, and metrics reads change nothing.

This module holds the option plumbing (CLI flag, ``ServerArgs`` attribute,
validation) and the aggregated expiry log; the expiry itself lives in
``session_tracker.py`` / ``session_idle.py``.
"""

from __future__ import annotations

import argparse
import logging
import math
from typing import Any, Optional

from sglang_session_cache.patches._wrap import PATCHED_FLAG, wrap_class_method
from sglang_session_cache.server_args_fields import drop_default_options

logger = logging.getLogger("sglang.srt.mem_cache.unified_radix_cache")
_args_logger = logging.getLogger("sglang.srt.server_args")

#: ``ServerArgs`` attribute (and ``sglang.Engine`` keyword) carrying the TTL.
TTL_FIELD = "session_radix_cache_ttl"
TTL_FLAG = "--session-radix-cache-ttl"
TTL_HELP = (
    "Seconds of inactivity after which a session's KV references are released "
    "as if /close_session had been called (the KV stays cached as ordinary LRU "
    "data). A session is idle only with no request in flight; its idle time "
    "starts when its last request ends. "
    "Default: off (sessions stay referenced until closed). 0 also turns it off. "
    "Needs --enable-session-radix-cache."
)
#: At most one "expired N idle sessions" info line per this many seconds.
EXPIRY_LOG_INTERVAL_S = 60.0


class SessionTTLError(ValueError):
    """Invalid --session-radix-cache-ttl value (or ``/open_session`` timeout)."""

#: How ``/open_session``'s timeout is named in its error message.
OPEN_TIMEOUT = "open_session timeout"


def normalize_ttl(value: Any, what: str = TTL_FLAG) -> Optional[float]:
    """``None``/``0`` -> ``None`` (off); a positive finite number -> float.
    Anything else raises ``SessionTTLError`` naming ``what`` (the flag, or
    ``/open_session``'s ``timeout``)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise SessionTTLError(f"{what} must be a number of seconds, got {value!r}")
    try:
        ttl = float(value)
    except (TypeError, ValueError):
        raise SessionTTLError(
            f"{what} must be a number of seconds, got {value!r}"
        ) from None
    if math.isnan(ttl) or math.isinf(ttl) or ttl < 0:
        off = " (0 = off)" if what == TTL_FLAG else ""
        raise SessionTTLError(
            f"{what} must be a finite number of seconds >= 0{off}, got {value!r}"
        )
    return ttl if ttl > 0 else None


def normalize_open_timeout(value: Any) -> Optional[float]:
    """``/open_session``'s ``timeout``: ``None`` (none) or seconds >= 0.
    Unlike the TTL flag, 0 is a timeout, not "off": SGLang's reaper ends
    such a session at its next pass."""
    ttl = normalize_ttl(value, OPEN_TIMEOUT)
    return 0.0 if ttl is None and value is not None else ttl


def configured_ttl(server_args: Any) -> Optional[float]:
    """The TTL a ``ServerArgs`` carries (``None`` when off or absent)."""
    if server_args is None:
        return None
    return normalize_ttl(getattr(server_args, TTL_FIELD, None))


def published_ttl() -> Optional[float]:
    """The TTL of the process-wide ``ServerArgs`` (``get_server_args()``), or
    ``None`` when none is published (e.g. a cache built outside a server)."""
    from sglang.srt.runtime_context import get_server_args

    try:
        server_args = get_server_args()
    except ValueError:  # "Global server args is not set yet!"
        return None
    return configured_ttl(server_args)


class ExpiryLog:
    """Aggregates expiries into one info line per ``interval`` seconds (of the
    tracker's clock): the first expiry is reported at once, later ones are
    summed until the interval has passed."""

    __slots__ = ("interval", "pending", "last")

    def __init__(self, interval: float = EXPIRY_LOG_INTERVAL_S):
        self.interval = interval
        self.pending = 0
        self.last: Optional[float] = None

    def add(self, n: int, now: float, ttl: Optional[float]) -> None:
        self.pending += n
        self.flush(now, ttl)

    def flush(self, now: float, ttl: Optional[float], force: bool = False) -> None:
        if not self.pending:
            return
        if not force and self.last is not None and now - self.last < self.interval:
            return
        logger.info(
            "Session radix cache: expired %d idle session%s (no activity for %gs); "
            "their references were released, the KV stays cached.",
            self.pending, "" if self.pending == 1 else "s", ttl or 0,
        )
        self.pending = 0
        self.last = now


# ---- ServerArgs plumbing -------------------------------------------------------


def _set_ttl(server_args, ttl: Optional[float]) -> None:
    # Construction-time value, not a post-resolution mutation: bypass the
    # strict-mutation guard of ServerArgs.__setattr__.
    object.__setattr__(server_args, TTL_FIELD, ttl)


def _parse_ttl_arg(text: str) -> Optional[float]:
    try:
        return normalize_ttl(text)
    except SessionTTLError as e:  # argparse prints it as a usage error
        raise argparse.ArgumentTypeError(str(e)) from None


def _wrap_add_cli_args(orig):
    def add_cli_args(parser):
        orig(parser)
        if any(a.dest == TTL_FIELD for a in parser._actions):
            return
        parser.add_argument(
            TTL_FLAG,
            dest=TTL_FIELD,
            type=_parse_ttl_arg,
            default=None,
            metavar="SECONDS",
            help=TTL_HELP,
        )

    return add_cli_args


def _wrap_from_cli_args(orig):
    def from_cli_args(cls, args):
        ttl = normalize_ttl(getattr(args, TTL_FIELD, None))
        server_args = orig(cls, args)
        _set_ttl(server_args, ttl)
        drop_default_options(server_args, {TTL_FIELD: None})
        return server_args

    return from_cli_args


def _wrap_init(orig):
    # ServerArgs(**kwargs) (sglang.Engine, launch helpers) accepts the option
    # as a keyword; it is stored as a plain instance attribute, which pickles
    # with the object into the scheduler processes.
    def __init__(self, *args, **kwargs):
        ttl = normalize_ttl(kwargs.pop(TTL_FIELD, None))
        _set_ttl(self, ttl)
        orig(self, *args, **kwargs)
        drop_default_options(self, {TTL_FIELD: None})

    return __init__


def patch_server_args_class(cls) -> None:
    if TTL_FIELD not in cls.__dict__:
        setattr(cls, TTL_FIELD, None)  # class default: off
    wrap_class_method(cls, "add_cli_args", _wrap_add_cli_args, PATCHED_FLAG)
    wrap_class_method(cls, "from_cli_args", _wrap_from_cli_args, PATCHED_FLAG)
    wrap_class_method(cls, "__init__", _wrap_init, PATCHED_FLAG)


__all__ = [
    "EXPIRY_LOG_INTERVAL_S",
    "ExpiryLog",
    "SessionTTLError",
    "TTL_FIELD",
    "TTL_FLAG",
    "configured_ttl",
    "normalize_open_timeout",
    "normalize_ttl",
    "patch_server_args_class",
    "published_ttl",
]
