"""Our ``ServerArgs`` options stay off the instance while they say nothing.

Each option (``--session-radix-cache-ttl``, the protection options, the DP
affinity options) has a class attribute holding its default and is set on the
instance at construction, so a value given on the command line or as a
keyword travels with the pickled ``ServerArgs`` to every process.  With the
session flag off and an option at its default the instance attribute is
dropped again: reads fall back to the class attribute (the same default), and
``vars(server_args)`` -- which SGLang returns from ``/get_server_info`` for
each scheduler -- stays exactly stock's.
"""

from __future__ import annotations

from typing import Any, Mapping

SESSION_FLAG = "enable_session_radix_cache"


def drop_default_options(server_args: Any, defaults: Mapping[str, Any]) -> None:
    """Remove ``{field: default}`` options that hold their default from the
    instance, unless the session flag is on (then they are part of the
    configuration a user may want to read back)."""
    if getattr(server_args, SESSION_FLAG, False):
        return
    attrs = vars(server_args)
    for field, default in defaults.items():
        if field in attrs and attrs[field] == default:
            del attrs[field]  # no __delattr__: bypasses ServerArgs' mutation guard


__all__ = ["SESSION_FLAG", "drop_default_options"]
