"""Probe for test_plugin_activation: run one SGLang process kind's real entry
function in this (fresh) interpreter and print, as the last stdout line, JSON
saying whether and how the patch set got activated there.

    python plugin_probe.py KIND

Each entry runs for real up to the point where it would need a model or a
GPU; there a stand-in named ``_ProbeStop...`` records the state and stops the
process with ``SystemExit`` (which the entries' ``except Exception`` blocks
let through, so no parent is signalled). SGLang's plugin loader, our plugin
and the patching are never replaced.
"""

from __future__ import annotations

import json
import sys

_STATE: dict = {}


def state() -> dict:
    from sglang_session_cache.activation import _hook_installed, applied_patches
    from sglang_session_cache.patch_table import PATCHES
    from sglang_session_cache.patches._wrap import PATCHED_FLAG

    plugins = sys.modules.get("sglang.srt.plugins")
    out = {
        "applied": applied_patches(),
        # what activation should have reached: every patched module imported so far
        "expected": [p.name for p in PATCHES if p.module in sys.modules],
        "hook_installed": _hook_installed(),
        "sglang_loaded_plugins": bool(plugins and plugins._plugins_loaded),
    }
    # from-import copies of wrapped module functions must be the wrapped ones
    copies = {
        ("sglang.srt.mem_cache.common", "evict_from_tree_cache"): (
            "sglang.srt.mem_cache.allocation", "sglang.srt.managers.schedule_batch"),
        ("sglang.srt.mem_cache.common", "free_swa_out_of_window_slots"): (
            "sglang.srt.mem_cache.unified_cache_components.swa_component",
            "sglang.srt.managers.schedule_batch"),
        ("sglang.srt.mem_cache.registry", "create_tree_cache"): (
            "sglang.srt.mem_cache.kv_cache_builder",),
    }
    stale = []
    for (src, name), importers in copies.items():
        if src not in sys.modules:
            continue
        fn = getattr(sys.modules[src], name)
        if not getattr(fn, PATCHED_FLAG, False):
            continue
        stale += [f"{m}.{name}" for m in importers
                  if m in sys.modules and getattr(sys.modules[m], name) is not fn]
    out["stale_copies"] = stale
    return out


def _stop(**extra):
    _STATE.update(state(), **extra)
    raise SystemExit(0)


def _server_args():
    from sglang.srt.runtime_context import get_context

    return get_context().override_server_args().install()


def cli():
    import runpy

    sys.argv = ["sglang.launch_server", "--help"]
    try:
        runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
    except SystemExit:
        pass
    from sglang.srt.server_args import ServerArgs

    _STATE.update(state(), ttl_option=hasattr(ServerArgs, "session_radix_cache_ttl"))


def engine():
    from sglang.srt.entrypoints.engine import Engine

    try:
        Engine(_probe_not_a_server_arg=1)  # load_plugins(), then ServerArgs(**kwargs) raises
    except TypeError:
        pass
    _STATE.update(state())


def scheduler():
    import sglang.srt.managers.scheduler as sched

    before = state()

    def _probe_stop_configure_scheduler_process(*args, **kwargs):
        # What the real function does first: configure_logger, through the
        # scheduler module's own binding (the plugin's log line goes to stderr).
        sched.configure_logger(_server_args())
        _stop(before=before)

    sched.configure_scheduler_process = _probe_stop_configure_scheduler_process
    sched.run_scheduler_process(None, None, 0, 0, 0, 0, 0, 0, None, None)


def detokenizer():
    from sglang.srt.managers.detokenizer_manager import run_detokenizer_process

    class _ProbeStopDetokenizerManager:
        def __init__(self, *args, **kwargs):
            _stop()

    run_detokenizer_process(_server_args(), None, _ProbeStopDetokenizerManager)


def dp_controller():
    import sglang.srt.managers.data_parallel_controller as dpc

    class _ProbeStopDataParallelController:
        def __init__(self, *args, **kwargs):
            _stop()

    dpc.DataParallelController = _ProbeStopDataParallelController
    dpc.run_data_parallel_controller_process(_server_args(), None, None)


def tokenizer_manager():
    # http_server.launch_server (and Engine) build the TokenizerManager in
    # Engine._launch_subprocesses, after its own load_plugins() call.
    import sglang.srt.entrypoints.engine as eng

    server_args = _server_args()
    server_args.check_server_args = lambda: _stop()
    eng._set_envs_and_config = lambda server_args: None  # process-wide env/signal set-up
    eng.Engine._launch_subprocesses(server_args, None, None, None)


def loader():
    # Plain code calling SGLang's loader itself, then importing a patched module.
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import sglang.srt.server_args  # noqa: F401

    _STATE.update(state())


def _spawn_child(queue):
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    queue.put({**state(), "marker": getattr(UnifiedRadixCache, "__sglang_session_cache__", None)})


def user():
    """Plain user code (no Engine, no CLI) and a multiprocessing spawn child."""
    import multiprocessing as mp

    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    _STATE.update(state(), marker=getattr(UnifiedRadixCache, "__sglang_session_cache__", None))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_spawn_child, args=(queue,))
    proc.start()
    _STATE["spawn_child"] = queue.get(timeout=600)
    proc.join(60)


KINDS = {f.__name__: f for f in (cli, engine, scheduler, detokenizer, dp_controller,
                                 tokenizer_manager, loader, user)}

if __name__ == "__main__":
    try:
        KINDS[sys.argv[1]]()
    except SystemExit:
        pass
    sys.stdout.write("\n" + json.dumps(_STATE) + "\n")
    sys.stdout.flush()
