"""Small helpers shared by the patch functions."""

from __future__ import annotations

import functools
import sys
import types

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
    if isinstance(cls, types.ModuleType):
        rebind_imported(original, wrapper)


def wrap_class_method(cls, name: str, make_wrapper, flag: str = PATCHED_FLAG) -> None:
    """``wrap_method`` for plain, static and class methods of a class: wraps the
    underlying function and re-applies the descriptor, once per ``flag`` (each
    option module layers its own wrapper on the same ``ServerArgs`` method)."""
    raw = cls.__dict__[name]
    kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
    func = raw.__func__ if kind is not None else raw
    if getattr(func, flag, False):
        return
    wrapper = make_wrapper(func)
    functools.update_wrapper(wrapper, func)
    setattr(wrapper, flag, True)
    setattr(cls, name, kind(wrapper) if kind is not None else wrapper)


def rebind_imported(original, wrapper) -> list[str]:
    """Point every ``from X import name`` copy of ``original`` in an already
    imported ``sglang`` module at ``wrapper``; returns those modules' names.

    Patched at import time (the ``.pth`` hook), a module function is wrapped
    before any importer runs its from-import, so this finds nothing. Patched
    late (SGLang's plugin loader runs after the scheduler module and
    everything it imports), the importers already hold the original."""
    rebound = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith("sglang."):
            continue
        namespace = getattr(mod, "__dict__", None)
        if not namespace:
            continue
        for attr, value in list(namespace.items()):
            if value is original:
                setattr(mod, attr, wrapper)
                rebound.append(mod_name)
    return rebound


def add_method(cls, name: str, fn) -> None:
    """Add (or replace) ``cls.name`` with ``fn`` unless ours is already there."""
    current = cls.__dict__.get(name)
    if current is not None and getattr(current, PATCHED_FLAG, False):
        return
    setattr(fn, PATCHED_FLAG, True)
    setattr(cls, name, fn)
