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
never uses more bytes than SGLang's own split of the same budget, both pools
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
``HybridSWAPoolConfigurator`` turns a size into (full, SWA) pools in two
methods, both through ``_solve_pool_sizes``: ``calculate_pool_sizes`` (from a
byte budget: the profiling path and the post-CUDA-graph resize, both via
``KVCacheConfigurator.config_from_budget``) and
``calculate_pool_sizes_from_max_tokens`` (from a constrained token count,
e.g. ``--max-total-tokens``). Both are wrapped, since the floor treats a
budget and a count differently (below). The configurator has no handle on
the server's request limits, so ``__init__`` (which receives the
``KVCacheConfigurator``) records a small sizing plan on the instance. Without
a plan (floor off: no Mamba, no sliding window, no extra buffer, radix cache
disabled, the C++ radix tree) or for all-SWA models (no full pool) the
original's result is returned untouched. ``SWAChunkCapPoolConfigurator``
(radix cache disabled) overrides both methods, and the DSV4 configurator is
another class: neither is touched.

The SWA pool is a function of the full pool
------------------------------------------
``config_from_budget`` solves from the byte budget, applies the token
constraints (``--max-total-tokens``, and with ``--pp-size > 1`` the minimum
over the pipeline stages) and, only where those changed the full pool,
solves again from the constrained count. Each PP stage has its own layers,
so a byte-neutral rebalance differs per stage, and applied to an already
rebalanced count it would shrink the full pool a second time: the stages
would end with different pools, where SGLang needs them identical. So every
result is ``(F, swa_tokens_for_full(F))`` -- the ratio-based SWA pool raised to the
minimum for ``resolve_max_num_reqs(F)`` and at most ``F`` -- which depends on
the full pool only:

* solving from bytes (``calculate_pool_sizes``) picks ``F`` by the rebalance
  above, then the SWA pool for that ``F`` (never more than the rebalance gave
  it, so the bytes stay within SGLang's split; where the minimum capped at
  the equal split and that SWA pool would not fit, ``F`` is the equal split);
* solving from a constrained count ``M`` no larger than the full pool this
  configurator solved from bytes (``calculate_pool_sizes_from_max_tokens``,
  as ``config_from_budget`` calls it) keeps ``F = M``, as stock does; its SWA
  pool fits in the bytes that solve had, since ``swa_tokens_for_full`` is
  non-decreasing;
* solving from a count with no byte solve before it falls back to the
  byte-neutral rebalance of that count.

A stage whose own full pool was the minimum keeps its solve; every other
stage re-solves from that same count and reaches the same pair.

Not reserved here, as for SGLang's own radix path: the slack between two SWA
evictions (``SGLANG_SWA_EVICTION_INTERVAL`` decode steps) and in-flight
prefill chunks; the tree's evictable SWA KV covers those.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, Optional

from sglang_session_cache.patches._wrap import wrap_method

_PLAN_ATTR = "_sglang_session_cache_swa_floor_plan"
# The full pool this configurator's last solve from bytes chose.
_BYTES_FULL_ATTR = "_sglang_session_cache_swa_floor_bytes_full"
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


def _equal_split(budget: int, full_token_bytes: int, swa_token_bytes: int,
                 page_size: int) -> int:
    """Tokens of each pool when ``budget`` bytes buy as many full as SWA
    tokens (page floored)."""
    return _floor_align(budget // (full_token_bytes + swa_token_bytes), page_size)


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
    equal = _equal_split(budget, full_token_bytes, swa_token_bytes, page_size)
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


def _stock_swa_tokens(configurator, full: int, page_size: int) -> int:
    # 0.5.16's hybrid split (``_solve_pool_sizes``): the page-floored ratio.
    return _floor_align(int(full * configurator._swa_full_tokens_ratio), page_size)


def swa_tokens_for_full(configurator, plan: SWAFloorSizingPlan, full: int,
                        page_size: int) -> tuple[int, int]:
    """``(SWA pool, running requests)`` for a full pool of ``full`` tokens:
    the ratio-based SWA pool raised to the page-rounded floor minimum for
    the requests SGLang derives from ``full``, the raise capped at ``full``.
    Non-decreasing in ``full``; a function of the full pool alone (see
    "The SWA pool is a function of the full pool")."""
    num_reqs = int(plan.resolve_max_num_reqs(full))
    need = _ceil_align(num_reqs * plan.tokens_per_request, page_size)
    return max(_stock_swa_tokens(configurator, full, page_size), min(need, full)), num_reqs


def _describe(plan: SWAFloorSizingPlan, num_reqs: int) -> str:
    return (
        f"{num_reqs} running requests x (sliding window {plan.sliding_window_size} "
        f"+ mamba track interval {plan.track_interval} + page {plan.page_size})"
    )


def _with_pools(config, full: int, swa: int):
    if (full, swa) == (config.full_max_total_num_tokens, config.swa_max_total_num_tokens):
        return config
    return dataclasses.replace(
        config,
        max_total_num_tokens=full,
        full_max_total_num_tokens=full,
        swa_max_total_num_tokens=swa,
    )


def apply_floor_minimum(
    configurator, config, plan: SWAFloorSizingPlan, logger, page_size: int
):
    """``config`` (SGLang's split of a budget) with the SWA pool raised to the
    floor minimum, paid by the full pool, never more bytes in total (see the
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
    minimum = num_reqs * plan.tokens_per_request
    if swa >= minimum:
        logger.info(
            "%s: swa_layer_tokens=%d covers the SWA pool minimum %d = %s; "
            "full_layer_tokens=%d unchanged",
            LOG_PREFIX, swa, minimum, _describe(plan, num_reqs), full,
        )
        return config
    full_bytes, swa_bytes = _token_bytes(configurator)
    budget = full * full_bytes + swa * swa_bytes
    new_full, _ = rebalance_for_swa_minimum(
        full,
        swa,
        min_swa_tokens=minimum,
        full_token_bytes=full_bytes,
        swa_token_bytes=swa_bytes,
        page_size=page_size,
    )
    # The SWA pool for the full pool chosen (a solve from that count must
    # reach the same pair, see the module docstring). It fits where the
    # rebalance reached the minimum; where the minimum capped at the equal
    # split it may not, and equal pools always do.
    new_swa, num_reqs = swa_tokens_for_full(configurator, plan, new_full, page_size)
    if new_full * full_bytes + new_swa * swa_bytes > budget:
        new_full = _equal_split(budget, full_bytes, swa_bytes, page_size)
        new_swa, num_reqs = swa_tokens_for_full(configurator, plan, new_full, page_size)
    minimum = num_reqs * plan.tokens_per_request
    if new_swa < minimum:
        logger.warning(
            "%s: the SWA pool minimum %d = %s does not fit below the full pool; "
            "swa_layer_tokens %d -> %d, full_layer_tokens %d -> %d%s. "
            "Lower --max-running-requests or --mamba-track-interval to keep "
            "decoded tokens reusable without SWA pressure.",
            LOG_PREFIX, minimum, _describe(plan, num_reqs), swa, new_swa, full, new_full,
            " (unchanged)" if new_swa == swa else " (SWA pool capped at the equal split)",
        )
    else:
        logger.info(
            "%s: SWA pool minimum %d = %s; swa_layer_tokens %d -> %d, "
            "full_layer_tokens %d -> %d (KV bytes %d -> %d)",
            LOG_PREFIX, minimum, _describe(plan, num_reqs), swa, new_swa, full, new_full,
            budget, new_full * full_bytes + new_swa * swa_bytes,
        )
    return _with_pools(config, new_full, new_swa)


def apply_floor_to_count(configurator, config, plan: SWAFloorSizingPlan, logger,
                         page_size: int):
    """``config`` (SGLang's split of a constrained token count no larger than
    the full pool this configurator solved from bytes) with the full pool
    kept, as stock keeps it, and the SWA pool for it; logs the sizes."""
    full = config.full_max_total_num_tokens
    swa = config.swa_max_total_num_tokens
    if not full or swa is None:
        return config
    try:
        new_swa, num_reqs = swa_tokens_for_full(configurator, plan, full, page_size)
    except Exception as exc:
        logger.debug("%s: pool sizing skipped (%r)", LOG_PREFIX, exc)
        return config
    minimum = num_reqs * plan.tokens_per_request
    level = logging.WARNING if new_swa < minimum else logging.INFO
    logger.log(
        level,
        "%s: full_layer_tokens=%d (constrained); SWA pool minimum %d = %s; "
        "swa_layer_tokens %d -> %d%s",
        LOG_PREFIX, full, minimum, _describe(plan, num_reqs), swa, new_swa,
        " (SWA pool capped at the full pool)" if new_swa < minimum else "",
    )
    return _with_pools(config, full, new_swa)


def _wrap_init(orig):
    def __init__(self, kvc, *args, **kwargs):
        orig(self, kvc, *args, **kwargs)
        setattr(self, _PLAN_ATTR, floor_sizing_plan(kvc))
        setattr(self, _BYTES_FULL_ATTR, None)

    return __init__


def _wrap_calculate_pool_sizes(orig, logger):
    def calculate_pool_sizes(self, available_bytes, page_size):
        config = orig(self, available_bytes, page_size)
        plan = getattr(self, _PLAN_ATTR, None)
        if plan is None:
            return config
        config = apply_floor_minimum(self, config, plan, logger, page_size)
        setattr(self, _BYTES_FULL_ATTR, config.full_max_total_num_tokens)
        return config

    return calculate_pool_sizes


def _wrap_from_max_tokens(orig, logger):
    def calculate_pool_sizes_from_max_tokens(self, max_total_num_tokens, page_size):
        config = orig(self, max_total_num_tokens, page_size)
        plan = getattr(self, _PLAN_ATTR, None)
        if plan is None:
            return config
        solved = getattr(self, _BYTES_FULL_ATTR, None)
        if solved is not None and config.full_max_total_num_tokens <= solved:
            return apply_floor_to_count(self, config, plan, logger, page_size)
        # No budget solved before: a byte-neutral split of this count.
        return apply_floor_minimum(self, config, plan, logger, page_size)

    return calculate_pool_sizes_from_max_tokens


def apply_pool_configurator(module) -> None:
    cls = module.HybridSWAPoolConfigurator
    logger = module.logger
    wrap_method(cls, "__init__", _wrap_init)
    wrap_method(
        cls, "calculate_pool_sizes",
        lambda orig: _wrap_calculate_pool_sizes(orig, logger),
    )
    wrap_method(
        cls, "calculate_pool_sizes_from_max_tokens",
        lambda orig: _wrap_from_max_tokens(orig, logger),
    )
