"""Server options of session DP affinity: CLI flags and ``ServerArgs`` fields.

Like ``--session-radix-cache-ttl`` (``session_ttl.py``), each option is a CLI
flag, a ``ServerArgs(...)`` / ``sglang.Engine(...)`` keyword, and a plain
instance attribute, so it reaches the spawned DP controller with the pickled
``ServerArgs``.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from sglang_session_cache.dp_affinity import DEFAULT_MAX_BINDINGS, DEFAULT_OVERLOAD_FACTOR
from sglang_session_cache.patches._wrap import wrap_class_method
from sglang_session_cache.server_args_fields import drop_default_options

DISABLE_FIELD = "disable_session_dp_affinity"
FACTOR_FIELD = "session_dp_affinity_overload_factor"
MAX_FIELD = "session_dp_affinity_max_sessions"
# Our own marker: the TTL options wrap the same ServerArgs methods and carry
# the shared patched flag, which must not make these wrappers skip.
_WRAPPED = "__sglang_session_cache_dp_affinity__"


class AffinityOptionError(ValueError):
    """Invalid session DP affinity option."""


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def normalize_factor(value: Any) -> float:
    if isinstance(value, bool):
        raise AffinityOptionError(f"{_flag(FACTOR_FIELD)} must be a number, got {value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise AffinityOptionError(
            f"{_flag(FACTOR_FIELD)} must be a number, got {value!r}") from None
    if math.isnan(v) or math.isinf(v) or v < 0 or 0 < v <= 1:
        raise AffinityOptionError(
            f"{_flag(FACTOR_FIELD)} must be 0 (guard off) or a finite number > 1 "
            f"(times the other ranks' mean load), got {value!r}")
    return v


def normalize_max(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise AffinityOptionError(
            f"{_flag(MAX_FIELD)} must be a positive integer, got {value!r}")
    try:
        v = int(value)
    except ValueError:
        raise AffinityOptionError(
            f"{_flag(MAX_FIELD)} must be a positive integer, got {value!r}") from None
    if v < 1:
        raise AffinityOptionError(
            f"{_flag(MAX_FIELD)} must be a positive integer, got {value!r}")
    return v


def normalize_disable(value: Any) -> bool:
    if not isinstance(value, bool):
        raise AffinityOptionError(f"{DISABLE_FIELD} must be True or False, got {value!r}")
    return value


# field -> (class default, normalizer, CLI help)
OPTIONS = {
    DISABLE_FIELD: (
        False, normalize_disable,
        "Turn off session affinity across DP ranks. By default, with "
        "--enable-session-radix-cache and --dp-size > 1, requests with a "
        "session_id go to the DP rank bound to their session.",
    ),
    FACTOR_FIELD: (
        DEFAULT_OVERLOAD_FACTOR, normalize_factor,
        "Session DP affinity overload guard: a session is moved to the "
        "least-loaded rank when its bound rank's load exceeds this many times "
        "the mean load of the other ranks, exceeds the lightest rank's by more "
        "than the request's tokens, and is over half the rank's capacity. "
        f"0 turns the guard off. Default {DEFAULT_OVERLOAD_FACTOR}.",
    ),
    MAX_FIELD: (
        DEFAULT_MAX_BINDINGS, normalize_max,
        "At most this many session -> DP rank bindings are kept; the least "
        f"recently used is dropped first. Default {DEFAULT_MAX_BINDINGS}.",
    ),
}


def _cli_type(normalizer):
    def parse(text: str):
        try:
            return normalizer(text)
        except AffinityOptionError as e:  # argparse prints it as a usage error
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def _defaults() -> dict:
    return {field: normalizer(default) for field, (default, normalizer, _) in OPTIONS.items()}


def _wrap_add_cli_args(orig):
    def add_cli_args(parser):
        orig(parser)
        dests = {a.dest for a in parser._actions}
        for field, (default, normalizer, help_text) in OPTIONS.items():
            if field in dests:
                continue
            if field == DISABLE_FIELD:
                parser.add_argument(_flag(field), dest=field, action="store_true",
                                    help=help_text)
            else:
                parser.add_argument(_flag(field), dest=field, type=_cli_type(normalizer),
                                    default=default, help=help_text)

    return add_cli_args


def _wrap_from_cli_args(orig):
    def from_cli_args(cls, args):
        values = {f: getattr(args, f, OPTIONS[f][0]) for f in OPTIONS}
        server_args = orig(cls, args)
        for field, value in values.items():
            object.__setattr__(server_args, field, OPTIONS[field][1](value))
        drop_default_options(server_args, _defaults())
        return server_args

    return from_cli_args


def _wrap_init(orig):
    def __init__(self, *args, **kwargs):
        for field, (default, normalizer, _) in OPTIONS.items():
            # Construction-time values: bypass ServerArgs' strict-mutation guard.
            object.__setattr__(self, field, normalizer(kwargs.pop(field, default)))
        orig(self, *args, **kwargs)
        drop_default_options(self, _defaults())

    return __init__


def patch_server_args_class(cls) -> None:
    for field, (default, _, _) in OPTIONS.items():
        if field not in cls.__dict__:
            setattr(cls, field, default)
    wrap_class_method(cls, "add_cli_args", _wrap_add_cli_args, _WRAPPED)
    wrap_class_method(cls, "from_cli_args", _wrap_from_cli_args, _WRAPPED)
    wrap_class_method(cls, "__init__", _wrap_init, _WRAPPED)


__all__ = [
    "AffinityOptionError",
    "DISABLE_FIELD",
    "FACTOR_FIELD",
    "MAX_FIELD",
    "OPTIONS",
    "patch_server_args_class",
]
