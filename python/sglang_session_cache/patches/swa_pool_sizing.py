"""SWA pool sizing for the SWA retain floor (issue 7, item 4).

Why
---
With the retain floor on (a hybrid SWA + Mamba model on the unified radix
tree with the Mamba extra buffer, i.e. ``--mamba-radix-cache-strategy
extra_buffer[_lazy]`` and ``--mamba-track-interval``), a running request keeps
the SWA KV from ``page_floor(checkpoint - sliding_window)`` to its tail, where
``checkpoint`` trails the tail by up to one track interval (see
``retain_floor``). Those slots belong to the request, so tree eviction cannot
reclaim them. Per running request that is at most::

    per_request = ceil_page(sliding_window) + track_interval + page_size

SGLang 0.5.16 sizes the SWA pool as ``swa_full_tokens_ratio`` x the full pool
(``HybridSWAPoolConfigurator._solve_pool_sizes``) and only checks that one
request's ``sliding_window + page_size`` fits. Nothing makes
``max_running_requests`` x ``per_request`` fit, so the extra retention could
starve a full batch of SWA slots (decode allocation failures, retractions).

What
----
The SWA pool minimum becomes::

    swa_floor_minimum = max_running_requests x per_request

where ``max_running_requests`` is what SGLang will derive from the full pool
(``KVCacheConfigurator.resolve_max_num_reqs(full_tokens)``, the very call that
follows the sizing). If the ratio-based SWA pool is smaller, KV bytes move
from the full pool to the SWA pool until it holds the minimum: the result
never uses more bytes than SGLang's own split for the same input, both pools
stay page aligned, and since ``resolve_max_num_reqs`` is non-decreasing in the
token capacity, the smaller full pool can only lower ``max_running_requests``,
so the minimum still holds for the request count SGLang then picks. An SWA
pool larger than the full pool would be useless (each SWA slot pairs with a
full slot), so when the minimum cannot be reached below that, the SWA pool
gets the equal split of the bytes (the full pool keeps at least as many
tokens, so the SWA pool never runs out before the full one) and a warning
says so. Both cases are the same bound: a request keeps at most
``min(its length, per_request)`` SWA slots of its own and its length in full
slots, so a batch can need at most ``min(max_running_requests x per_request,
full pool)`` of them. The chosen sizes are logged through SGLang's
``sglang.srt.model_executor.pool_configurator`` logger.

The seam
--------
``HybridSWAPoolConfigurator._solve_pool_sizes`` is the one place 0.5.16 turns
a token count into (full, SWA) pool sizes: the profiling path
(``calculate_pool_sizes``), the constraint path
(``calculate_pool_sizes_from_max_tokens``, e.g. ``--max-total-tokens``) and the
post-CUDA-graph resize (``config_from_budget``) all go through it. It has no
handle on the server's request limits, so ``__init__`` (which receives the
``KVCacheConfigurator``) records a small sizing plan on the instance; the
wrapped ``_solve_pool_sizes`` applies it to the original's result. Without a
plan (floor off: no Mamba, no sliding window, no extra buffer, radix cache
disabled, the C++ radix tree) or for all-SWA models (no full pool) the
original's result is returned untouched. ``SWAChunkCapPoolConfigurator``
(radix cache disabled) and the DSV4 configurator never call
``_solve_pool_sizes``.

Not reserved here, as for SGLang's own radix path: the slack between two SWA
evictions (``SGLANG_SWA_EVICTION_INTERVAL`` decode steps) and in-flight
prefill chunks; the tree's evictable SWA KV covers those.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

from sglang_session_cache.patches._wrap import wrap_method

_PLAN_ATTR = "_sglang_session_cache_swa_floor_plan"
LOG_PREFIX = "SWA retain floor"


# ---- arithmetic (pure) --------------------------------------------------------


def _ceil_align(x: int, page_size: int) -> int:
    return -(-x // page_size) * page_size


def _floor_align(x: int, page_size: int) -> int:
    return x // page_size * page_size


def swa_floor_tokens_per_request(
    *, sliding_window_size: int, track_interval: int, page_size: int
) -> int:
    """SWA slots one running request may hold with the retain floor on:
    the page-rounded window under its last checkpoint, one track interval of
    tail past it, and one page for the frontier's page flooring."""
    return _ceil_align(sliding_window_size, page_size) + track_interval + page_size


def swa_floor_pool_minimum(
    *,
    max_running_requests: int,
    sliding_window_size: int,
    track_interval: int,
    page_size: int,
) -> int:
    """``max_running_requests`` x :func:`swa_floor_tokens_per_request`."""
    return max(0, max_running_requests) * swa_floor_tokens_per_request(
        sliding_window_size=sliding_window_size,
        track_interval=track_interval,
        page_size=page_size,
    )


def rebalance_for_swa_minimum(
    full_tokens: int,
    swa_tokens: int,
    *,
    min_swa_tokens: int,
    full_token_bytes: int,
    swa_token_bytes: int,
    page_size: int,
) -> tuple[int, int]:
    """``(full, swa)`` with ``swa >= min_swa_tokens`` (page aligned), paid for
    by the full pool, never costing more bytes than ``(full_tokens,
    swa_tokens)``.

    Unchanged when the SWA pool already holds the minimum. If the minimum
    cannot be reached with ``swa <= full``, the SWA pool gets the equal split
    ``page_floor(bytes / (full_token_bytes + swa_token_bytes))`` and the full
    pool the rest (at least as many tokens), or both stay unchanged if that
    would not grow the SWA pool."""
    if swa_tokens >= min_swa_tokens:
        return full_tokens, swa_tokens
    assert full_token_bytes > 0 and swa_token_bytes > 0, (full_token_bytes, swa_token_bytes)
    budget = full_tokens * full_token_bytes + swa_tokens * swa_token_bytes
    target = _ceil_align(min_swa_tokens, page_size)
    equal = _floor_align(budget // (full_token_bytes + swa_token_bytes), page_size)
    if target > equal:
        target = equal
        if target <= swa_tokens:
            return full_tokens, swa_tokens
    # budget >= target * (full + swa bytes), so new_full >= target.
    new_full = _floor_align((budget - target * swa_token_bytes) // full_token_bytes, page_size)
    return new_full, target


# ---- the plan recorded by HybridSWAPoolConfigurator.__init__ ------------------


@dataclass(frozen=True)
class SWAFloorSizingPlan:
    sliding_window_size: int
    track_interval: int
    page_size: int
    # KVCacheConfigurator.resolve_max_num_reqs: full-pool tokens -> requests.
    resolve_max_num_reqs: Callable[[int], int]

    @property
    def tokens_per_request(self) -> int:
        return swa_floor_tokens_per_request(
            sliding_window_size=self.sliding_window_size,
            track_interval=self.track_interval,
            page_size=self.page_size,
        )


def floor_sizing_plan(kvc) -> Optional[SWAFloorSizingPlan]:
    """The plan when the retain floor will be active for this server's tree
    cache, else ``None``.

    Active means: ``--enable-session-radix-cache`` on, a Mamba-ish (linear
    attention) model with a sliding window and the Mamba extra buffer (which ``ServerArgs.enable_mamba_extra_buffer``
    only reports with the radix cache on), built as a ``UnifiedRadixCache``
    (0.5.16's registry does so for hybrid SWA unless
    ``SGLANG_EXPERIMENTAL_CPP_RADIX_TREE`` picks the C++ tree)."""
    server_args = kvc.server_args
    # The floor it pays for is part of the session feature (see
    # swa_retain_floor): without the flag, SGLang's own split, untouched.
    if not getattr(server_args, "enable_session_radix_cache", False):
        return None
    window = kvc.sliding_window_size
    if getattr(kvc, "mambaish_config", None) is None or not window:
        return None
    if not server_args.enable_mamba_extra_buffer():
        return None
    from sglang.srt.environ import envs

    if envs.SGLANG_EXPERIMENTAL_CPP_RADIX_TREE.get():
        return None
    interval = int(server_args.mamba_track_interval or 0)
    if interval <= 0:
        return None
    return SWAFloorSizingPlan(
        sliding_window_size=int(window),
        track_interval=interval,
        page_size=int(kvc.page_size),
        resolve_max_num_reqs=kvc.resolve_max_num_reqs,
    )


# ---- sglang.srt.model_executor.pool_configurator ------------------------------


def _token_bytes(configurator) -> tuple[int, int]:
    """Bytes per full-pool token and per SWA-pool token, as
    ``HybridSWAPoolConfigurator.__init__`` prices them (the full term carries
    the draft model's layers)."""
    c = configurator
    full = (
        c._full_per_token * (c._full_layers_num + c._draft_full_layers_num)
        + c._swa_per_token * c._draft_swa_full_layers_num
    )
    swa = c._swa_per_token * c._swa_layers_num
    return int(full), int(swa)


def apply_floor_minimum(
    configurator, config, plan: SWAFloorSizingPlan, logger, page_size: int
):
    """``config`` with the SWA pool raised to the floor minimum (see the
    module docstring); logs the chosen sizes."""
    full = config.full_max_total_num_tokens
    swa = config.swa_max_total_num_tokens
    if not full or swa is None:
        return config  # all-SWA model: no full pool to pay with
    try:
        num_reqs = int(plan.resolve_max_num_reqs(full))
    except Exception as exc:  # SGLang's own call right after reports it
        logger.debug("%s: pool sizing skipped (%r)", LOG_PREFIX, exc)
        return config
    per_request = plan.tokens_per_request
    minimum = num_reqs * per_request
    what = (
        f"{num_reqs} running requests x (sliding window {plan.sliding_window_size} "
        f"+ mamba track interval {plan.track_interval} + page {plan.page_size})"
    )
    if swa >= minimum:
        logger.info(
            "%s: swa_layer_tokens=%d covers the SWA pool minimum %d = %s; "
            "full_layer_tokens=%d unchanged",
            LOG_PREFIX, swa, minimum, what, full,
        )
        return config
    full_bytes, swa_bytes = _token_bytes(configurator)
    new_full, new_swa = rebalance_for_swa_minimum(
        full,
        swa,
        min_swa_tokens=minimum,
        full_token_bytes=full_bytes,
        swa_token_bytes=swa_bytes,
        page_size=page_size,
    )
    if new_swa < minimum:
        logger.warning(
            "%s: the SWA pool minimum %d = %s does not fit below the full pool; "
            "swa_layer_tokens %d -> %d, full_layer_tokens %d -> %d%s. "
            "Lower --max-running-requests or --mamba-track-interval to keep "
            "decoded tokens reusable without SWA pressure.",
            LOG_PREFIX, minimum, what, swa, new_swa, full, new_full,
            " (unchanged)" if new_swa == swa else " (SWA pool capped at the equal split)",
        )
    else:
        logger.info(
            "%s: SWA pool minimum %d = %s; swa_layer_tokens %d -> %d, "
            "full_layer_tokens %d -> %d (KV bytes %d -> %d)",
            LOG_PREFIX, minimum, what, swa, new_swa, full, new_full,
            full * full_bytes + swa * swa_bytes,
            new_full * full_bytes + new_swa * swa_bytes,
        )
    if (new_full, new_swa) == (full, swa):
        return config
    return dataclasses.replace(
        config,
        max_total_num_tokens=new_full,
        full_max_total_num_tokens=new_full,
        swa_max_total_num_tokens=new_swa,
    )


def _wrap_init(orig):
    def __init__(self, kvc, *args, **kwargs):
        orig(self, kvc, *args, **kwargs)
        setattr(self, _PLAN_ATTR, floor_sizing_plan(kvc))

    return __init__


def _wrap_solve_pool_sizes(orig, logger):
    def _solve_pool_sizes(self, max_total_num_tokens, page_size):
        config = orig(self, max_total_num_tokens, page_size)
        plan = getattr(self, _PLAN_ATTR, None)
        if plan is None:
            return config
        return apply_floor_minimum(self, config, plan, logger, page_size)

    return _solve_pool_sizes


def apply_pool_configurator(module) -> None:
    cls = module.HybridSWAPoolConfigurator
    logger = module.logger
    wrap_method(cls, "__init__", _wrap_init)
    wrap_method(
        cls, "_solve_pool_sizes", lambda orig: _wrap_solve_pool_sizes(orig, logger)
    )
