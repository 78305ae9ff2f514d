"""Version marker: proves that patching reached ``UnifiedRadixCache``."""

MARKER_ATTR = "__sglang_session_cache__"


def apply(module) -> None:
    from sglang_session_cache import __version__

    setattr(module.UnifiedRadixCache, MARKER_ATTR, __version__)
