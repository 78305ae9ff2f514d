"""Small helpers shared by the patch functions."""

from __future__ import annotations

import functools

PATCHED_FLAG = "__sglang_session_cache_patched__"


def wrap_method(cls, name: str, make_wrapper) -> None:  # cls may be a module
    """Replace ``cls.name`` with ``make_wrapper(original)``, once.

    The wrapper keeps the original reachable as ``__wrapped__`` and is tagged,
    so applying the same patch again (e.g. after a reload) is a no-op."""
    original = cls.__dict__.get(name)
    if original is None:
        original = getattr(cls, name)
    if getattr(original, PATCHED_FLAG, False):
        return
    wrapper = make_wrapper(original)
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, PATCHED_FLAG, True)
    setattr(cls, name, wrapper)


def add_method(cls, name: str, fn) -> None:
    """Add (or replace) ``cls.name`` with ``fn`` unless ours is already there."""
    current = cls.__dict__.get(name)
    if current is not None and getattr(current, PATCHED_FLAG, False):
        return
    setattr(fn, PATCHED_FLAG, True)
    setattr(cls, name, fn)
