"""``ServerArgs`` plumbing for the protection policy options
(``protection_policy.py``):

* ``--session-radix-cache-max-protected-fraction auto|F`` (``0 < F <= 1``, default ``auto``)
* ``--session-radix-cache-protect-from-turn auto|N`` (``N >= 1``, default ``auto``)

Both are CLI flags and ``ServerArgs(...)`` / ``sglang.Engine(...)`` keywords,
stored as instance attributes (class default ``None`` = the default value), so
they reach the scheduler processes with the pickled ``ServerArgs``.  Invalid
values fail at startup with the flag's name.
"""

from __future__ import annotations

import argparse

from sglang_session_cache.patches._wrap import wrap_class_method
from sglang_session_cache.server_args_fields import drop_default_options
from sglang_session_cache.protection_policy import (
    DEFAULT_MAX_PROTECTED_FRACTION,
    DEFAULT_PROTECT_FROM_TURN,
    FRACTION_FIELD,
    FRACTION_FLAG,
    FROM_TURN_FIELD,
    FROM_TURN_FLAG,
    ProtectionOptionError,
    normalize_fraction,
    normalize_from_turn,
)

# Own marker: these wrappers layer over the TTL option's wrappers of the same
# ServerArgs methods (which carry the shared PATCHED_FLAG).
_MARK = "__sglang_session_cache_protection_options__"

_OPTIONS = (
    (FRACTION_FIELD, FRACTION_FLAG, normalize_fraction, "{auto,F}",
     "Most of each KV pool (share, 0 < F <= 1) that session references may "
     "protect; past it, protection is withdrawn from the least recently active "
     "sessions first (their KV stays cached). 'auto': up to 0.9, learned from "
     "the misses protection causes: unreferenced KV it pushed out (down) and "
     "returning sessions' own unprotected KV (up). "
     f"Default: {DEFAULT_MAX_PROTECTED_FRACTION}. Needs --enable-session-radix-cache."),
    (FROM_TURN_FIELD, FROM_TURN_FLAG, normalize_from_turn, "{auto,N}",
     "A session's KV is protected from its N-th request on (2: conversations "
     "that never return protect nothing; 1: from the first request). 'auto' "
     "learns 1 or 2 from how often recent sessions sent a second request. "
     f"Default: {DEFAULT_PROTECT_FROM_TURN}. Needs --enable-session-radix-cache."),
)


#: What each option holds when not given (its normalized default).
_DEFAULTS = {field: normalize(None) for field, _, normalize, _, _ in _OPTIONS}


def _parser_type(normalize):
    def parse(text):
        try:
            return normalize(text)
        except ProtectionOptionError as e:  # printed as a usage error
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def _wrap_add_cli_args(orig):
    def add_cli_args(parser):
        orig(parser)
        present = {a.dest for a in parser._actions}
        for field, flag, normalize, metavar, help_text in _OPTIONS:
            if field not in present:
                parser.add_argument(flag, dest=field, type=_parser_type(normalize),
                                    default=None, metavar=metavar, help=help_text)

    return add_cli_args


def _wrap_from_cli_args(orig):
    def from_cli_args(cls, args):
        values = {f: n(getattr(args, f, None)) for f, _, n, _, _ in _OPTIONS}
        server_args = orig(cls, args)
        for field, value in values.items():
            object.__setattr__(server_args, field, value)
        drop_default_options(server_args, _DEFAULTS)
        return server_args

    return from_cli_args


def _wrap_init(orig):
    def __init__(self, *args, **kwargs):
        for field, _, normalize, _, _ in _OPTIONS:
            # Construction-time value: bypass the strict-mutation guard.
            object.__setattr__(self, field, normalize(kwargs.pop(field, None)))
        orig(self, *args, **kwargs)
        drop_default_options(self, _DEFAULTS)

    return __init__


def patch_server_args_class(cls) -> None:
    for field, *_ in _OPTIONS:
        if field not in cls.__dict__:
            setattr(cls, field, None)  # class default: the option's default
    wrap_class_method(cls, "add_cli_args", _wrap_add_cli_args, _MARK)
    wrap_class_method(cls, "from_cli_args", _wrap_from_cli_args, _MARK)
    wrap_class_method(cls, "__init__", _wrap_init, _MARK)


__all__ = ["patch_server_args_class"]
