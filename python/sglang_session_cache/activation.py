"""Activation: the import hook that applies the patch table, and its guards.

How patches get applied
-----------------------
``sglang_session_cache.pth`` (at the root of site-packages) imports
``sglang_session_cache._autoload`` at start-up of every interpreter in the
environment -- spawn children included -- which calls :func:`install_hook`.
That puts a :class:`SessionCachePatchFinder` at the front of ``sys.meta_path``.

The finder ignores every import outside the ``sglang`` package at the cost of
one string comparison. For a module named in ``patch_table.PATCHES`` it asks
the remaining finders for the real spec and wraps the real loader: after the
real ``exec_module`` has run, the matching patch functions are called with the
module object. The wrapper hands the module its real loader back, so nothing
downstream sees the wrapper.

:func:`activate` does the same explicitly: installs the hook (idempotent) and
patches target modules that are already imported.

Guards
------
* Version: before anything is patched, the installed sglang version is read
  from package metadata. Anything but exactly ``0.5.16`` is refused with one
  warning per process, and SGLang runs unpatched.
* Idempotence: applied patch names are kept in a module-level set; a patch is
  never applied twice in one process.
* Fail loud: a patch function that raises is logged (with the patch name) and
  the exception propagates, so the import of the patched module fails.

Environment
-----------
``SGLANG_SESSION_CACHE_DISABLE=1``
    turns the start-up autoload off (see ``_autoload``); an explicit
    :func:`activate` call still works.
``SGLANG_SESSION_CACHE_FAKE_SGLANG_VERSION=X``
    TEST-ONLY. Makes the version guard see sglang ``X`` instead of the
    installed version. It affects nothing but the guard.

This module must stay cheap to import (stdlib built-ins only at import time).
"""

from __future__ import annotations

import _thread
import sys

from sglang_session_cache.version_guard import (  # noqa: F401 (re-exported)
    FAKE_VERSION_ENV,
    REQUIRED_SGLANG_VERSION,
    check_sglang_version,
    installed_sglang_version,
)

# Root packages that may hold patched modules. The finder's fast path rejects
# every other import without looking at the patch table.
WATCHED_ROOTS = frozenset({"sglang"})

_UNSET = object()

_lock = _thread.RLock()
_local = _thread._local()
_APPLIED: set[str] = set()  # names of patches applied in this process
_APPLIED_ORDER: list[str] = []  # same names, in the order they were applied
_RUNNING: set[str] = set()  # patches being applied right now
_WARNED: set[str] = set()  # refusal messages already logged
_refusal_cache: object = _UNSET  # None (accepted) or the refusal message
_targets_cache: tuple[object, dict] | None = None


def _logger():
    import logging

    return logging.getLogger(__name__)


# --------------------------------------------------------------------------
# Version guard (the checks live in version_guard; this keeps the verdict)
# --------------------------------------------------------------------------


def _refusal() -> str | None:
    """The guard's verdict for this process, computed once."""
    global _refusal_cache
    with _lock:
        if _refusal_cache is _UNSET:
            _refusal_cache = check_sglang_version(installed_sglang_version())
        return _refusal_cache  # type: ignore[return-value]


def _warn_once(message: str) -> None:
    with _lock:
        if message in _WARNED:
            return
        _WARNED.add(message)
    _logger().warning(message)


# --------------------------------------------------------------------------
# Patch table access
# --------------------------------------------------------------------------


def _targets() -> dict:
    """``{module name: [Patch, ...]}`` from ``patch_table.PATCHES``, cached
    for as long as ``PATCHES`` is the same object."""
    global _targets_cache
    from sglang_session_cache import patch_table

    table = patch_table.PATCHES
    cached = _targets_cache
    if cached is not None and cached[0] is table:
        return cached[1]
    by_module: dict = {}
    seen: set[str] = set()
    for patch in table:
        if patch.name in seen:
            raise ValueError(f"sglang-session-cache: duplicate patch name {patch.name!r}")
        seen.add(patch.name)
        if patch.module.partition(".")[0] not in WATCHED_ROOTS:
            raise ValueError(
                f"sglang-session-cache: patch {patch.name!r} targets {patch.module!r}, "
                f"outside the watched packages {sorted(WATCHED_ROOTS)}"
            )
        by_module.setdefault(patch.module, []).append(patch)
    _targets_cache = (table, by_module)
    return by_module


def _apply_for(module_name: str, module) -> None:
    """Run every not-yet-applied patch for ``module_name`` on ``module``."""
    from sglang_session_cache.patch_table import resolve

    for patch in _targets().get(module_name, ()):
        with _lock:
            if patch.name in _APPLIED or patch.name in _RUNNING:
                continue
            _RUNNING.add(patch.name)
        try:
            resolve(patch)(module)
        except Exception as exc:
            with _lock:
                _RUNNING.discard(patch.name)
            _logger().error(
                "sglang-session-cache: patch %r (%s) failed on %s: %s: %s",
                patch.name,
                patch.apply,
                module_name,
                type(exc).__name__,
                exc,
            )
            raise
        with _lock:
            _RUNNING.discard(patch.name)
            _APPLIED.add(patch.name)
            _APPLIED_ORDER.append(patch.name)


# --------------------------------------------------------------------------
# Import hook
# --------------------------------------------------------------------------


class _PatchingLoader:
    """Wraps a module's real loader; runs the patches after ``exec_module``."""

    def __init__(self, loader, fullname: str):
        self._ssc_loader = loader
        self._ssc_fullname = fullname

    def create_module(self, spec):
        create = getattr(self._ssc_loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module) -> None:
        real = self._ssc_loader
        # Give the module its real loader back before it runs, so that
        # inspect/linecache/importlib.resources never see this wrapper.
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = real
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = real
        real.exec_module(module)  # errors of the module itself propagate as-is
        _apply_for(self._ssc_fullname, module)

    def __getattr__(self, name):
        return getattr(self._ssc_loader, name)


class SessionCachePatchFinder:
    """``sys.meta_path`` finder that wraps the loaders of patched modules."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] not in WATCHED_ROOTS:
            return None  # fast path: every import outside sglang
        patches = _targets().get(fullname)
        if not patches:
            return None
        with _lock:
            if all(p.name in _APPLIED for p in patches):
                return None
        refusal = _refusal()
        if refusal is not None:
            _warn_once(refusal)
            return None
        busy = getattr(_local, "busy", None)
        if busy is None:
            busy = _local.busy = set()
        if fullname in busy:
            return None  # another finder is searching on our behalf: no recursion
        busy.add(fullname)
        try:
            spec = self._find_real_spec(fullname, path, target)
        finally:
            busy.discard(fullname)
        if spec is None or spec.loader is None:
            return None  # let the normal machinery report it
        if not hasattr(spec.loader, "exec_module"):
            _logger().warning(
                "sglang-session-cache: %s has a legacy loader %r; not patched",
                fullname,
                spec.loader,
            )
            return None
        spec.loader = _PatchingLoader(spec.loader, fullname)
        return spec

    def _find_real_spec(self, fullname, path, target):
        for finder in list(sys.meta_path):
            if isinstance(finder, SessionCachePatchFinder):
                continue
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None

    def __repr__(self) -> str:
        return "<sglang_session_cache.SessionCachePatchFinder>"


_FINDER = SessionCachePatchFinder()


def _hook_installed() -> bool:
    return any(isinstance(f, SessionCachePatchFinder) for f in sys.meta_path)


def install_hook() -> SessionCachePatchFinder:
    """Put the finder at the front of ``sys.meta_path`` (idempotent).

    Cheap: needs neither the patch table nor the sglang version until a
    module inside a watched package is imported."""
    with _lock:
        for finder in sys.meta_path:
            if isinstance(finder, SessionCachePatchFinder):
                return finder
        sys.meta_path.insert(0, _FINDER)
        return _FINDER


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------


def activate() -> bool:
    """Activate explicitly: check the sglang version, install the import hook
    (idempotent) and patch the target modules that are already imported.

    Returns True if the patch set is active, False if the version guard
    refused (one warning is logged per process; SGLang runs unpatched).
    Ignores ``SGLANG_SESSION_CACHE_DISABLE``, which only governs autoload."""
    refusal = _refusal()
    if refusal is not None:
        _warn_once(refusal)
        return False
    install_hook()
    for module_name in _targets():
        module = sys.modules.get(module_name)
        if module is None:
            continue
        spec = getattr(module, "__spec__", None)
        if spec is not None and getattr(spec, "_initializing", False):
            # Mid-import: patching a half-executed module would fail. If the
            # hook wrapped its loader, the patches run when exec_module ends.
            continue
        _apply_for(module_name, module)
    return True


def is_active() -> bool:
    """True if the import hook is installed and the sglang version is supported."""
    return _hook_installed() and _refusal() is None


def applied_patches() -> list[str]:
    """Names of the patches applied in this process, in application order."""
    with _lock:
        return list(_APPLIED_ORDER)
