"""Session-aware KV eviction for SGLang's ``UnifiedRadixCache`` (sglang==0.5.16).

Importing this package is cheap on purpose: it is imported at interpreter
start-up by ``sglang_session_cache.pth`` and must not pull in sglang or torch.
The patches themselves are applied lazily, when SGLang imports the modules
listed in :mod:`sglang_session_cache.patch_table`.
"""

__version__ = "0.1.0"

from sglang_session_cache.activation import activate, applied_patches, is_active

__all__ = ["__version__", "activate", "applied_patches", "is_active"]
