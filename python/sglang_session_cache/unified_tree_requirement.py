"""``--enable-session-radix-cache`` needs the unified radix tree: fail fast otherwise.

Session references live on ``UnifiedRadixCache`` only. SGLang 0.5.16 builds it
when ``SGLANG_ENABLE_UNIFIED_RADIX_TREE=1`` -- and also *without* the variable
for hybrid models (SWA with full-attention layers, Mamba/linear-attention
hybrids: ``mem_cache/registry.py``). So failing on the variable alone would be
wrong for those models. Two checks:

* at ``ServerArgs`` validation (main process, before any process spawns):
  ``--disable-radix-cache`` always fails; without the variable, a model whose
  config shows no hybrid layout fails. When the config cannot be read there
  (e.g. a remote or dummy model) the decision is left to
* the tree-cache factory in the scheduler (``create_tree_cache``): the cache
  it built has no session tracker -> the same error, and the launch fails
  before the server serves anything.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

logger = logging.getLogger("sglang.srt.server_args")

UNIFIED_ENV = "SGLANG_ENABLE_UNIFIED_RADIX_TREE"
NEEDS_UNIFIED = (
    "--enable-session-radix-cache needs the unified radix tree (UnifiedRadixCache), "
    "but this server would build {kind}. Start it with {env}=1 (or drop "
    "--enable-session-radix-cache)."
)
NO_TREE = (
    "--enable-session-radix-cache needs a radix cache, but --disable-radix-cache is "
    "set. Drop one of the two (and start with {env}=1)."
)


def _unified_env_set() -> bool:
    from sglang.srt.environ import envs

    return bool(envs.SGLANG_ENABLE_UNIFIED_RADIX_TREE.get())


def _model_is_hybrid(server_args: Any) -> Optional[bool]:
    """Whether the model gets the unified tree without the variable (hybrid
    SWA / SSM layout, as kv_cache_builder decides), or ``None`` when unknown."""
    try:
        from sglang.srt.configs import hybrid_arch

        mc = server_args.get_model_config()
        if getattr(mc, "is_hybrid_swa", False):
            return True
        for name in ("hybrid_gdn_config", "mamba2_config", "kimi_linear_config",
                     "hybrid_lightning_config"):
            fn = getattr(hybrid_arch, name, None)
            if fn is not None and fn(mc) is not None:
                return True
        spec_fn = getattr(hybrid_arch, "linear_attn_model_spec", None)
        spec = spec_fn(mc) if spec_fn is not None else None
        return bool(spec is not None and getattr(spec, "uses_mamba_radix_cache", False))
    except Exception as e:  # unreadable config: the scheduler-side check decides
        logger.debug("session radix cache: model layout unknown at validation (%s)", e)
        return None


def startup_problem(server_args: Any) -> Optional[str]:
    """The error for a server that would run the flag without the unified tree."""
    if not getattr(server_args, "enable_session_radix_cache", False):
        return None
    if getattr(server_args, "disable_radix_cache", False):
        return NO_TREE.format(env=UNIFIED_ENV)
    if _unified_env_set():
        return None
    if _model_is_hybrid(server_args) is False:
        return NEEDS_UNIFIED.format(kind="RadixCache", env=UNIFIED_ENV)
    return None


def built_cache_problem(server_args: Any, cache: Any) -> Optional[str]:
    if not getattr(server_args, "enable_session_radix_cache", False):
        return None
    if getattr(cache, "session_ref_tracker", None) is not None:
        return None
    return NEEDS_UNIFIED.format(kind=type(cache).__name__, env=UNIFIED_ENV)


__all__ = ["NEEDS_UNIFIED", "NO_TREE", "built_cache_problem", "startup_problem"]
