"""Version guard: this patch set supports exactly one SGLang release.

Split out of :mod:`sglang_session_cache.activation` so that the patch table and
the activation hook both read the required version without importing each
other. Stdlib only at import time (imported at interpreter start-up).
"""

from __future__ import annotations

import os

REQUIRED_SGLANG_VERSION = "0.5.16"

# TEST-ONLY: overrides the sglang version seen by the version guard.
FAKE_VERSION_ENV = "SGLANG_SESSION_CACHE_FAKE_SGLANG_VERSION"


def _release_tuple(version: str) -> tuple[int, ...] | None:
    """Fallback parser for when ``packaging`` is missing: '0.5.16' -> (0, 5, 16)."""
    parts = version.strip().split(".")
    if not parts or not all(p.isdigit() for p in parts):
        return None
    return tuple(int(p) for p in parts)


def _compare(found: str) -> int | None:
    """-1/0/1 for found older/equal/newer than required, 2 for a build of
    the required release with a post-release or local label (``0.5.16.post1``,
    ``0.5.16+cu130``); None if unparsable."""
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:  # pragma: no cover - packaging is a declared dependency
        got, want = _release_tuple(found), _release_tuple(REQUIRED_SGLANG_VERSION)
        if got is None or want is None:
            return None
        return (got > want) - (got < want)
    try:
        got = Version(found)
    except InvalidVersion:
        return None
    want = Version(REQUIRED_SGLANG_VERSION)
    if got > want and got.release == want.release:
        return 2
    return (got > want) - (got < want)


def check_sglang_version(found: str | None) -> str | None:
    """Return ``None`` if ``found`` is the supported sglang version, else the
    refusal message to log. ``found=None`` means sglang is not installed."""
    prefix = "sglang-session-cache: refusing to activate: "
    required = f"this patch set requires sglang=={REQUIRED_SGLANG_VERSION} exactly."
    if found is None:
        return f"{prefix}sglang is not installed (no package metadata); {required}"
    cmp = _compare(found)
    if cmp == 0:
        return None
    message = f"{prefix}found sglang {found}, {required}"
    if cmp == 2:
        # Same release number, but not the release: its code may differ.
        message += (
            f" A post-release or local build of {REQUIRED_SGLANG_VERSION} may change "
            "the code this patch set hooks into."
        )
    elif cmp is not None and cmp > 0:
        message += (
            " Newer SGLang releases ship a native session radix cache "
            "(--enable-session-radix-cache); use that instead."
        )
    return message + " SGLang will run unpatched."


def installed_sglang_version() -> str | None:
    """The sglang version the guard checks (package metadata, or the test-only
    fake from ``SGLANG_SESSION_CACHE_FAKE_SGLANG_VERSION``)."""
    fake = os.environ.get(FAKE_VERSION_ENV, "").strip()
    if fake:
        return fake
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None
