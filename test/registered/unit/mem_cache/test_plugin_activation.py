"""Activation through SGLang's own plugin loader, one test per process kind.

Each case runs ``plugin_probe.py KIND`` in a fresh interpreter: the real entry
function of that process kind (CLI ``launch_server`` main, ``Engine``,
``run_scheduler_process``, ``run_detokenizer_process``,
``run_data_parallel_controller_process``, ``Engine._launch_subprocesses``
where the tokenizer manager is built, plain user code, a multiprocessing spawn
child), with SGLang's real ``sglang.srt.plugins.load_plugins`` finding this
package through its installed entry point.

``SGLANG_SESSION_CACHE_AUTOLOAD=0`` switches the ``.pth`` import hook off, so
these runs show what SGLang's loader reaches on its own; the default runs show
what the ``.pth`` hook adds (plain user code and its spawn children, which no
SGLang loader reaches). See README "How activation works".
"""

import json
import os
import subprocess
import sys
from importlib import metadata

import pytest

from sglang_session_cache.plugin import PLUGIN_NAME
from sglang_session_cache.version_guard import REQUIRED_SGLANG_VERSION

HERE = os.path.dirname(os.path.abspath(__file__))
PLUGIN_ONLY = {"SGLANG_SESSION_CACHE_AUTOLOAD": "0"}
ACTIVE_LINE = f"active (SGLang plugin {PLUGIN_NAME})"
OUR_ENV = ("SGLANG_SESSION_CACHE_DISABLE", "SGLANG_SESSION_CACHE_AUTOLOAD", "SGLANG_PLUGINS",
           "SGLANG_SESSION_CACHE_FAKE_SGLANG_VERSION")


RUNS = {
    # SGLang's entry points with the .pth hook off: what the plugin alone reaches
    "cli": ("cli", PLUGIN_ONLY),
    "engine": ("engine", PLUGIN_ONLY),
    "scheduler": ("scheduler", PLUGIN_ONLY),
    "tokenizer_manager": ("tokenizer_manager", PLUGIN_ONLY),
    "detokenizer": ("detokenizer", PLUGIN_ONLY),
    "dp_controller": ("dp_controller", PLUGIN_ONLY),
    # user code (and its spawn child) without / with the .pth hook
    "user_plugin_only": ("user", PLUGIN_ONLY),
    "user_default": ("user", {}),
    # switches, through SGLang's loader
    "filtered_out": ("loader", {"SGLANG_PLUGINS": "some_other_plugin"}),
    "filtered_in": ("loader", {"SGLANG_PLUGINS": f"x, {PLUGIN_NAME}", **PLUGIN_ONLY}),
    "disabled": ("loader", {"SGLANG_SESSION_CACHE_DISABLE": "1"}),
    "other_version": ("loader", {"SGLANG_SESSION_CACHE_FAKE_SGLANG_VERSION": "0.5.17",
                                 **PLUGIN_ONLY}),
}
PARALLEL = 4  # fresh interpreters at a time (each imports sglang: ~1 GB, CPU-bound)


@pytest.fixture(scope="module")
def probes() -> dict:
    """Every run in RUNS, PARALLEL at a time: name -> (state, stdout + stderr)."""
    pending, running, results = list(RUNS.items()), {}, {}
    while pending or running:
        while pending and len(running) < PARALLEL:
            name, (kind, extra) = pending.pop(0)
            env = {k: v for k, v in os.environ.items() if k not in OUR_ENV}
            env.update(extra)
            running[name] = subprocess.Popen(
                [sys.executable, os.path.join(HERE, "plugin_probe.py"), kind], env=env,
                cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        name = next(iter(running))
        stdout, stderr = running.pop(name).communicate(timeout=900)
        results[name] = (stdout, stderr)
    out = {}
    for name, (stdout, stderr) in results.items():
        lines = stdout.strip().splitlines()
        try:
            state = json.loads(lines[-1])
        except (IndexError, ValueError):
            state = None
        out[name] = (state, stdout + stderr)
    return out


def run(probes, name) -> tuple[dict, str]:
    state, output = probes[name]
    assert state, f"{name}: probe failed:\n{output[-4000:]}"
    return state, output


def assert_fully_patched(state: dict) -> None:
    # Every patched module imported so far is patched, by-name copies included.
    assert state["applied"] and sorted(state["applied"]) == sorted(state["expected"])
    assert state["hook_installed"]  # modules imported later are patched on import
    assert state["stale_copies"] == []


def test_entry_point_is_registered():
    eps = metadata.entry_points(group="sglang.srt.plugins")
    ours = [ep for ep in eps if ep.name == PLUGIN_NAME]
    assert len(ours) == 1 and ours[0].value == "sglang_session_cache.plugin:load_plugin"
    assert ours[0].dist.name == "sglang-session-cache"


# ---- processes SGLang's loader reaches: the plugin alone is enough -------------------------


def test_cli_main_process(probes):
    state, output = run(probes, "cli")
    assert state["sglang_loaded_plugins"]
    assert_fully_patched(state)
    assert state["ttl_option"]
    assert "--session-radix-cache-ttl" in output  # argparse help built after load_plugins()


def test_engine(probes):
    state, _ = run(probes, "engine")
    assert state["sglang_loaded_plugins"]
    assert_fully_patched(state)
    assert "server_args.session_radix_cache_ttl" in state["applied"]


def test_scheduler_process(probes):
    state, output = run(probes, "scheduler")
    # The scheduler stack is imported (unpatched) before load_plugins() runs ...
    before = state["before"]
    assert before["applied"] == [] and "scheduler.session_forwarding" in before["expected"]
    # ... and patched in place by it, from-import copies included.
    assert state["sglang_loaded_plugins"]
    assert_fully_patched(state)
    for name in ("scheduler.session_forwarding", "common.admission_shortfall_eviction",
                 "registry.unified_tree_required"):
        assert name in state["applied"]
    # The cache module itself is imported later: the hook patches it then.
    assert "unified_radix_cache.session_refs" not in state["expected"]
    # The server log names the plugin once logging is configured.
    assert output.count(ACTIVE_LINE) == 1


def test_tokenizer_manager_main_process(probes):
    state, output = run(probes, "tokenizer_manager")
    assert state["sglang_loaded_plugins"]
    assert_fully_patched(state)
    # Here logging is configured before load_plugins(): SGLang's own line shows.
    assert f"Loaded plugin {PLUGIN_NAME} from group sglang.srt.plugins" in output


# ---- processes it does not reach: they hold no cache and need no patch ----------------------


@pytest.mark.parametrize("name", ["detokenizer", "dp_controller"])
def test_processes_without_a_cache_are_not_reached(probes, name):
    state, _ = run(probes, name)
    assert not state["sglang_loaded_plugins"]
    assert state["applied"] == []
    # No tree cache lives here (the DP controller's schedulers load plugins themselves).
    assert not any(n.startswith("unified_radix_cache.") for n in state["expected"])


# ---- user code: only the .pth hook reaches it -------------------------------------------------


def test_user_code_and_spawn_children_need_the_pth_hook(probes):
    state, _ = run(probes, "user_plugin_only")
    for s in (state, state["spawn_child"]):
        assert not s["sglang_loaded_plugins"]
        assert s["applied"] == [] and s["marker"] is None
    state, _ = run(probes, "user_default")
    for s in (state, state["spawn_child"]):
        assert_fully_patched(s)
        assert s["marker"] is not None


# ---- switches --------------------------------------------------------------------------------


def test_sglang_plugins_filter_excludes_both_paths(probes):
    state, _ = run(probes, "filtered_out")  # .pth hook left on: it honours the filter too
    assert state["sglang_loaded_plugins"]
    assert state["applied"] == [] and not state["hook_installed"]


def test_sglang_plugins_filter_naming_us(probes):
    state, _ = run(probes, "filtered_in")
    assert_fully_patched(state)


def test_disable_env_turns_the_plugin_off(probes):
    state, output = run(probes, "disabled")
    assert state["sglang_loaded_plugins"]  # SGLang loaded it; it did nothing
    assert state["applied"] == [] and not state["hook_installed"]
    assert ACTIVE_LINE not in output


def test_version_guard_refuses_through_the_plugin(probes):
    state, output = run(probes, "other_version")
    assert state["sglang_loaded_plugins"]
    assert state["applied"] == [] and not state["hook_installed"]
    assert f"found sglang 0.5.17, this patch set requires sglang=={REQUIRED_SGLANG_VERSION}" in output
    assert output.count("refusing to activate") == 1
