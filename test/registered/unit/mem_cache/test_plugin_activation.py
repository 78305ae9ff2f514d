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


def probe(kind: str, **env) -> tuple[dict, str]:
    full_env = {k: v for k, v in os.environ.items() if k not in OUR_ENV}
    full_env.update(env)
    out = subprocess.run([sys.executable, os.path.join(HERE, "plugin_probe.py"), kind],
                         env=full_env, cwd=HERE, capture_output=True, text=True, timeout=420)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stdout + out.stderr


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


def test_cli_main_process():
    state, output = probe("cli", **PLUGIN_ONLY)
    assert state["sglang_loaded_plugins"]
    assert_fully_patched(state)
    assert state["ttl_option"]
    assert "--session-radix-cache-ttl" in output  # argparse help built after load_plugins()


def test_engine():
    state, _ = probe("engine", **PLUGIN_ONLY)
    assert state["sglang_loaded_plugins"]
    assert_fully_patched(state)
    assert "server_args.session_radix_cache_ttl" in state["applied"]


def test_scheduler_process():
    state, output = probe("scheduler", **PLUGIN_ONLY)
    # The scheduler stack is imported (unpatched) before load_plugins() runs ...
    before = state["before"]
    assert before["applied"] == [] and "scheduler.session_forwarding" in before["expected"]
    # ... and patched in place by it, from-import copies included.
    assert state["sglang_loaded_plugins"]
    assert_fully_patched(state)
    for name in ("scheduler.session_forwarding", "common.admission_shortfall_eviction",
                 "registry.no_effect_guard"):
        assert name in state["applied"]
    # The cache module itself is imported later: the hook patches it then.
    assert "unified_radix_cache.session_refs" not in state["expected"]
    # The server log names the plugin once logging is configured.
    assert output.count(ACTIVE_LINE) == 1


def test_tokenizer_manager_main_process():
    state, _ = probe("tokenizer_manager", **PLUGIN_ONLY)
    assert state["sglang_loaded_plugins"]
    assert_fully_patched(state)


# ---- processes it does not reach: they hold no cache and need no patch ----------------------


@pytest.mark.parametrize("kind", ["detokenizer", "dp_controller"])
def test_processes_without_a_cache_are_not_reached(kind):
    state, _ = probe(kind, **PLUGIN_ONLY)
    assert not state["sglang_loaded_plugins"]
    assert state["applied"] == []
    # No tree cache lives here (the DP controller's schedulers load plugins themselves).
    assert not any(n.startswith("unified_radix_cache.") for n in state["expected"])


# ---- user code: only the .pth hook reaches it -------------------------------------------------


@pytest.mark.parametrize("kind", ["plain", "spawn"])
def test_user_code_needs_the_pth_hook(kind):
    state, _ = probe(kind, **PLUGIN_ONLY)
    assert not state["sglang_loaded_plugins"]
    assert state["applied"] == [] and state["marker"] is None
    state, _ = probe(kind)  # default: the .pth hook is on
    assert_fully_patched(state)
    assert state["marker"] is not None


# ---- switches --------------------------------------------------------------------------------


def test_sglang_plugins_filter_excludes_both_paths():
    state, _ = probe("scheduler", SGLANG_PLUGINS="some_other_plugin")
    assert state["applied"] == [] and not state["hook_installed"]
    state, _ = probe("plain", SGLANG_PLUGINS="some_other_plugin")
    assert state["applied"] == [] and not state["hook_installed"]


def test_sglang_plugins_filter_naming_us():
    state, _ = probe("scheduler", SGLANG_PLUGINS=f"x, {PLUGIN_NAME}", **PLUGIN_ONLY)
    assert_fully_patched(state)


def test_disable_env_turns_the_plugin_off():
    state, output = probe("scheduler", SGLANG_SESSION_CACHE_DISABLE="1")
    assert state["sglang_loaded_plugins"]  # SGLang loaded it; it did nothing
    assert state["applied"] == [] and not state["hook_installed"]
    assert ACTIVE_LINE not in output


def test_version_guard_refuses_through_the_plugin():
    state, output = probe("scheduler", SGLANG_SESSION_CACHE_FAKE_SGLANG_VERSION="0.5.17",
                          **PLUGIN_ONLY)
    assert state["sglang_loaded_plugins"]
    assert state["applied"] == [] and not state["hook_installed"]
    assert f"found sglang 0.5.17, this patch set requires sglang=={REQUIRED_SGLANG_VERSION}" in output
    assert output.count("refusing to activate") == 1
