"""The table of what sglang-session-cache patches, and where.

Every change this project makes to SGLang is one ``Patch`` entry below. The
import hook in :mod:`sglang_session_cache.activation` watches the modules named
here; right after SGLang executes one of them, the hook resolves each matching
entry's ``apply`` path and calls it with the freshly executed module object.

Adding a patch:
  1. write ``fn(module)`` in ``sglang_session_cache/patches/<file>.py``;
  2. add a ``Patch`` entry here (``name`` must be unique; ``module`` must be
     inside the ``sglang`` package);
  3. ``python -m sglang_session_cache.patch_table`` lists the table.

Entries for the same module run in table order. This module must stay cheap to
import: ``apply`` is a dotted string, resolved only when the patch runs.

Print the table: ``python -m sglang_session_cache.patch_table``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from sglang_session_cache.version_guard import REQUIRED_SGLANG_VERSION


@dataclass(frozen=True)
class Patch:
    name: str  # unique id, e.g. "unified_radix_cache.session_tracker"
    module: str  # SGLang module to patch, e.g. "sglang.srt.mem_cache.unified_radix_cache"
    targets: tuple[str, ...]  # human-readable "Class.method" list it touches
    apply: str  # "package.module:function", resolved lazily, called as fn(module_obj)
    why: str


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="unified_radix_cache.version_marker",
        module="sglang.srt.mem_cache.unified_radix_cache",
        targets=("UnifiedRadixCache.__sglang_session_cache__",),
        apply="sglang_session_cache.patches.marker:apply",
        why=(
            "Tags UnifiedRadixCache with the sglang-session-cache version, so "
            "a running process can tell that patching reached the class."
        ),
    ),
    Patch(
        name="tree_component.session_fields",
        module="sglang.srt.mem_cache.unified_cache_components.tree_component",
        targets=("ComponentData.session_ref", "ComponentData.session_below",
                 "ComponentData.session_leaf_of"),
        apply="sglang_session_cache.patches.unified_cache:apply_component_data",
        why="Per-node, per-component session counts, as class-level defaults "
        "so untouched nodes cost nothing.",
    ),
    Patch(
        name="unified_radix_cache.session_refs",
        module="sglang.srt.mem_cache.unified_radix_cache",
        targets=(
            "UnifiedRadixCache.__init__", "UnifiedRadixCache._reset_full",
            "UnifiedRadixCache.cache_finished_req",
            "UnifiedRadixCache._split_node", "UnifiedRadixCache._remove_leaf_from_parent",
            "UnifiedRadixCache._evict_component_and_detach_lru",
            "UnifiedRadixCache._check_lru_linked_list",
            "UnifiedRadixCache.match_prefix",
            "UnifiedRadixCache.open_radix_session (new)",
            "UnifiedRadixCache.release_radix_session (new)",
            "UnifiedRadixCache.ensure_session_generation (new)",
            "UnifiedRadixCache.validate_session_state (new)",
        ),
        apply="sglang_session_cache.patches.unified_cache:apply_unified_cache",
        why="With enable_session_radix_cache: composes UnifiedSessionRefTracker, "
        "swaps in session-aware SWA/Mamba components via "
        "component_registry_override, partitioned LRUs and the FULL heap key "
        "(the heap kept across evictions under the lru policy); "
        "registers refs after a finished request's insert and keeps counts "
        "right across splits and evictions (a session cache also gets its own "
        "_evict_device_leaf, on the instance, with those hooks in line, and "
        "under lru an _update_evictable_leaf_sets that feeds the kept heap). "
        "Inert with the flag off.",
    ),
    Patch(
        name="radix_cache.legacy_sessions_off",
        module="sglang.srt.mem_cache.radix_cache",
        targets=("RadixCache.__init__", "RadixCache.release_radix_session"),
        apply="sglang_session_cache.patches.server_wiring:apply_legacy_radix_cache",
        why="Only UnifiedRadixCache owns sessions: the old SessionRadixCacheMixin "
        "tagging and bulk-free on close no longer run.",
    ),
    Patch(
        name="server_args.lift_priority_requirement",
        module="sglang.srt.server_args",
        targets=("ServerArgs._handle_cache_compatibility",),
        apply="sglang_session_cache.patches.server_wiring:apply_server_args",
        why="--enable-session-radix-cache no longer requires "
        "--radix-eviction-policy priority; other checks unchanged. Fails fast "
        "when the flag would have no effect (no unified tree for this model, "
        "see unified_tree_requirement.py).",
    ),
    Patch(
        name="server_args.session_flag_help",
        module="sglang.srt.server_args",
        targets=("ServerArgs.add_cli_args",),
        apply="sglang_session_cache.patches.server_wiring:apply_server_args_help",
        why="--help of --enable-session-radix-cache says what the flag does "
        "here; stock's text describes the old mixin (bulk eviction on close, "
        "priority policy required).",
    ),
    Patch(
        name="registry.unified_tree_required",
        module="sglang.srt.mem_cache.registry",
        targets=("create_tree_cache",),
        apply="sglang_session_cache.patches.server_wiring:apply_registry",
        why="Start-up error (not a warning) when the flag is on but the cache "
        "built is not the unified tree: the flag would silently do nothing.",
    ),
    Patch(
        name="scheduler.session_forwarding",
        module="sglang.srt.managers.scheduler",
        targets=("Scheduler.open_session", "Scheduler.close_session",
                 "Scheduler._add_request_to_queue", "Scheduler.abort_request",
                 "Scheduler._abort_on_queued_limit", "Scheduler._abort_on_waiting_timeout",
                 "Scheduler.handle_generate_request"),
        apply="sglang_session_cache.patches.server_wiring:apply_scheduler",
        why="open/close forward to the cache; top-level session_id requests get "
        "their session generation on arrival and count as in flight until "
        "they finish or leave the queue (refused, aborted while queued, "
        "preempted by the queue limit, dropped by the queue wait timeout); an "
        "/open_session timeout restarts when the controller creates a request; bad ids are logged or aborted instead "
        "of crashing the scheduler.",
    ),
    Patch(
        name="tokenizer_manager.session_id_rule",
        module="sglang.srt.managers.tokenizer_manager",
        targets=("TokenizerManager.generate_request", "TokenizerManager.open_session",
                 "TokenizerManager.close_session"),
        apply="sglang_session_cache.patches.session_id_edge:apply_tokenizer_manager",
        why="With the flag on, session ids breaking the one rule (session_ids.py: "
        "non-empty, not whitespace-only, str, <= 256 chars, no control "
        "characters) get a ValueError -> HTTP 400 before reaching the scheduler.",
    ),
    Patch(
        name="common.swa_retain_floor",
        module="sglang.srt.mem_cache.common",
        targets=("free_swa_out_of_window_slots",),
        apply="sglang_session_cache.patches.swa_retain_floor:apply_common",
        why="Accepts retain_floor=None: on the radix path the SWA eviction "
        "threshold becomes min(threshold, retain_floor), by lowering pre_len "
        "before calling the original; None and the chunk cache call it unchanged.",
    ),
    Patch(
        name="common.admission_shortfall_eviction",
        module="sglang.srt.mem_cache.common",
        targets=("evict_from_tree_cache",
                 "sglang.srt.mem_cache.allocation.evict_from_tree_cache (by-name import)",
                 "sglang.srt.managers.schedule_batch.evict_from_tree_cache (by-name import)"),
        apply="sglang_session_cache.patches.admission_eviction:apply_common",
        why="With --enable-session-radix-cache, admission on the standard "
        "allocator evicts only the shortfall (num_tokens - available), as the "
        "SWA branch already does; 0.5.16 evicts all num_tokens. Stock without "
        "the flag.",
    ),
    Patch(
        name="base_prefix_cache.swa_retain_floor",
        module="sglang.srt.mem_cache.base_prefix_cache",
        targets=("BasePrefixCache.swa_retain_floor (new)",),
        apply="sglang_session_cache.patches.swa_retain_floor:apply_base_prefix_cache",
        why="Default: no SWA retain floor (None), so every other cache keeps "
        "evicting relative to the tail.",
    ),
    Patch(
        name="unified_radix_cache.swa_retain_floor",
        module="sglang.srt.mem_cache.unified_radix_cache",
        targets=("UnifiedRadixCache.swa_retain_floor (new)",),
        apply="sglang_session_cache.patches.swa_retain_floor:apply_unified_radix_cache",
        why="With SWA + Mamba, matches end at the last Mamba checkpoint: keep "
        "SWA KV from mamba_last_track_seqlen - sliding_window_size so the window "
        "under it survives decode and the next turn reuses decoded tokens.",
    ),
    Patch(
        name="swa_component.swa_retain_floor",
        module="sglang.srt.mem_cache.unified_cache_components.swa_component",
        targets=("SWAComponent.free_out_of_window_slots",),
        apply="sglang_session_cache.patches.swa_retain_floor:apply_swa_component",
        why="The chunked-prefill eviction path passes the cache's retain floor.",
    ),
    Patch(
        name="schedule_batch.swa_retain_floor",
        module="sglang.srt.managers.schedule_batch",
        targets=("ScheduleBatch._evict_swa",),
        apply="sglang_session_cache.patches.swa_retain_floor:apply_schedule_batch",
        why="Decode-side SWA eviction passes the tree cache's retain floor.",
    ),
    Patch(
        name="server_args.session_radix_cache_ttl",
        module="sglang.srt.server_args",
        targets=("ServerArgs.add_cli_args", "ServerArgs.from_cli_args",
                 "ServerArgs.__init__", "ServerArgs.session_radix_cache_ttl (new)"),
        apply="sglang_session_cache.patches.server_wiring:apply_server_args_ttl",
        why="--session-radix-cache-ttl SECONDS (and the session_radix_cache_ttl "
        "keyword): validated, stored on the ServerArgs instance (default None = "
        "off) so it reaches the scheduler with the pickled ServerArgs.",
    ),
    Patch(
        name="server_args.session_radix_cache_protection",
        module="sglang.srt.server_args",
        targets=("ServerArgs.add_cli_args", "ServerArgs.from_cli_args",
                 "ServerArgs.__init__",
                 "ServerArgs.session_radix_cache_max_protected_fraction (new)",
                 "ServerArgs.session_radix_cache_protect_from_turn (new)"),
        apply="sglang_session_cache.patches.server_wiring:apply_server_args_protection",
        why="--session-radix-cache-max-protected-fraction F (bound on referenced "
        "data per pool) and --session-radix-cache-protect-from-turn N (earned "
        "protection), and their keywords: validated, stored on the ServerArgs "
        "instance (default None = the documented default); read by the cache at init.",
    ),
    Patch(
        name="unified_radix_cache.session_ttl_metrics",
        module="sglang.srt.mem_cache.unified_radix_cache",
        targets=("UnifiedRadixCache.evict",
                 "UnifiedRadixCache.session_metrics (new)",
                 "UnifiedRadixCache.expire_idle_sessions (new)",
                 "UnifiedRadixCache.advance_session_clock (new)"),
        apply="sglang_session_cache.patches.unified_cache:apply_session_ttl_metrics",
        why="TTL expiry on the shared clock (advance_session_clock, fed in "
        "scheduler order, identical on every rank); session_metrics() snapshot "
        "(a read never mutates). The session_refs wrappers read the TTL from "
        "get_server_args() at init, count requests in flight per session and "
        "count evictions of referenced data. evict() first enforces the "
        "protection bound (protection_policy.py), one comparison per component.",
    ),
    Patch(
        name="disagg_prefill.failed_transfer_no_ref",
        module="sglang.srt.disaggregation.prefill",
        targets=("SchedulerDisaggregationPrefillMixin.handle_inflight_transfer_failure",
                 "SchedulerDisaggregationPrefillMixin.handle_bootstrap_failure"),
        apply="sglang_session_cache.patches.disagg_abort:apply_prefill",
        why="SGLang releases a failed PD prefill request's KV before marking it "
        "aborted; the request is marked first so its finish registers no "
        "session reference.",
    ),
    Patch(
        name="request_receiver.session_clock_tick",
        module="sglang.srt.managers.scheduler_components.request_receiver",
        targets=("SchedulerRequestReceiver._broadcast_reqs_across_ranks",),
        apply="sglang_session_cache.patches.session_clock:apply_request_receiver",
        why="With --enable-session-radix-cache the rank that reads the tokenizer "
        "socket appends one clock value (SharedClockTick) to the polled batch "
        "before the broadcast, so every TP/CP rank and PP stage sees the same "
        "TTL clock in the same order.",
    ),
    Patch(
        name="scheduler.session_clock_tick",
        module="sglang.srt.managers.scheduler",
        targets=("Scheduler.process_input_requests",),
        apply="sglang_session_cache.patches.session_clock:apply_scheduler",
        why="Takes the SharedClockTick out of the batch (SGLang never sees it) "
        "and advances the cache's TTL clock before the batch's requests.",
    ),
    Patch(
        name="pool_stats_observer.session_metrics",
        module="sglang.srt.managers.scheduler_components.pool_stats_observer",
        targets=("SchedulerPoolStatsObserver.get_pool_stats",
                 "PoolStats.get_prefill_usage_msg_parts",
                 "PoolStats.get_decode_usage_msg_parts",
                 "PoolStats.update_scheduler_stats"),
        apply="sglang_session_cache.patches.server_wiring:apply_pool_stats",
        why="The scheduler's prefill/decode log lines gain a 'session: open=..., "
        "ref_tokens(...)=..., breaches=...' part, and with --enable-metrics the "
        "sglang:session_radix_* Prometheus series are published with the "
        "scheduler's own stats. Only for session-tracking caches.",
    ),
    Patch(
        name="server_args.session_dp_affinity",
        module="sglang.srt.server_args",
        targets=("ServerArgs.add_cli_args", "ServerArgs.from_cli_args",
                 "ServerArgs.__init__",
                 "ServerArgs.disable_session_dp_affinity (new)",
                 "ServerArgs.session_dp_affinity_overload_factor (new)",
                 "ServerArgs.session_dp_affinity_max_sessions (new)"),
        apply="sglang_session_cache.patches.dp_controller:apply_server_args",
        why="--disable-session-dp-affinity, --session-dp-affinity-overload-factor "
        "and --session-dp-affinity-max-sessions (and keywords): validated, "
        "stored on the ServerArgs instance so they reach the DP controller "
        "process with the pickled ServerArgs.",
    ),
    Patch(
        name="data_parallel_controller.session_affinity",
        module="sglang.srt.managers.data_parallel_controller",
        targets=("DataParallelController.init_dispatcher",
                 "DataParallelController.dispatching (per instance)",
                 "DataParallelController.session_router (new)"),
        apply="sglang_session_cache.patches.dp_controller:apply_dp_controller",
        why="With the session cache on and dp_size > 1: a SessionDPRouter sends "
        "requests with a session to the DP rank bound to that session (first "
        "turn: least-loaded rank; overload guard; bindings end on close, TTL, "
        "LRU cap); routed_dp_rank and session-less requests keep the configured "
        "method. Unchanged otherwise.",
    ),
    Patch(
        name="pool_configurator.swa_floor_pool_minimum",
        module="sglang.srt.model_executor.pool_configurator",
        targets=("HybridSWAPoolConfigurator.__init__",
                 "HybridSWAPoolConfigurator.calculate_pool_sizes",
                 "HybridSWAPoolConfigurator.calculate_pool_sizes_from_max_tokens"),
        apply="sglang_session_cache.patches.swa_pool_sizing:apply_pool_configurator",
        why="With the SWA retain floor on (SWA + Mamba, extra buffer, radix "
        "cache), the SWA pool holds at least max_running_requests x (window + "
        "mamba track interval + page): KV bytes move from the full pool when "
        "the ratio-based SWA pool is smaller, never more bytes in total; the "
        "SWA pool depends on the full pool only, so a re-solve from a token "
        "cap or the PP-stage minimum keeps that full pool on every stage; the "
        "chosen sizes are logged. Unchanged otherwise.",
    ),
)


def resolve(patch: Patch) -> Callable[[object], None]:
    """Import and return the function named by ``patch.apply``."""
    mod_name, sep, attr = patch.apply.partition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(
            f"patch {patch.name!r}: apply must look like 'package.module:function', "
            f"got {patch.apply!r}"
        )
    fn = importlib.import_module(mod_name)
    for part in attr.split("."):
        fn = getattr(fn, part)
    if not callable(fn):
        raise TypeError(f"patch {patch.name!r}: {patch.apply!r} is not callable")
    return fn


def patches_for(module_name: str, patches: tuple[Patch, ...] | None = None) -> list[Patch]:
    """Entries that patch ``module_name``, in table order."""
    table = PATCHES if patches is None else patches
    return [p for p in table if p.module == module_name]


def format_table(patches: tuple[Patch, ...] | None = None) -> str:
    table = PATCHES if patches is None else patches
    lines = [
        f"sglang-session-cache patch table "
        f"({len(table)} patch{'es' if len(table) != 1 else ''}, "
        f"requires sglang=={REQUIRED_SGLANG_VERSION})",
        "",
    ]
    for p in table:
        lines.append(f"{p.name}")
        lines.append(f"  module:  {p.module}")
        lines.append(f"  targets: {', '.join(p.targets)}")
        lines.append(f"  apply:   {p.apply}")
        lines.append(f"  why:     {p.why}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    import sys

    sys.stdout.write(format_table())


if __name__ == "__main__":
    main()
