"""Activation of the patch set: .pth autoload, spawn children, the disable
switch, idempotence, fail-loud patches, the sglang version guard and the
patch-table CLI.

The subprocess tests start fresh interpreters of this venv with no explicit
``activate()`` call: whatever they see patched was patched by the .pth
autoload. Each one imports SGLang (~10 s on CPU).
"""

import importlib
import json
import logging
import multiprocessing
import os
import subprocess
import sys
import sysconfig
import textwrap
import uuid
from importlib import metadata

import pytest

import sglang_session_cache
from sglang_session_cache import activation, patch_table
from sglang_session_cache.patch_table import PATCHES, Patch

URC = "sglang.srt.mem_cache.unified_radix_cache"
MARKER_PATCH = "unified_radix_cache.version_marker"
MARKER_ATTR = "__sglang_session_cache__"
TIMEOUT = 600

# Run in a fresh interpreter: import the patched module, report what happened.
PROBE = textwrap.dedent(
    f"""
    import json, sys
    import sglang.srt.mem_cache.unified_radix_cache as m
    import sglang_session_cache as ssc
    from sglang_session_cache import activation
    report = {{
        "marker": getattr(m.UnifiedRadixCache, "{MARKER_ATTR}", None),
        "applied": ssc.applied_patches(),
        "active": ssc.is_active(),
        "autoloaded": "sglang_session_cache._autoload" in sys.modules,
        "hooked": any(isinstance(f, activation.SessionCachePatchFinder) for f in sys.meta_path),
        "loader": type(m.__loader__).__name__,
    }}
    if "--activate" in sys.argv:
        report["activate"] = ssc.activate()
        report["marker_after"] = getattr(m.UnifiedRadixCache, "{MARKER_ATTR}", None)
        report["applied_after"] = ssc.applied_patches()
    print("REPORT " + json.dumps(report))
    """
)


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_SESSION_CACHE_")}
    env.update(extra)
    return env


def _run_probe(*args, **env):
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=os.path.dirname(os.path.abspath(__file__)),
    )
    assert proc.returncode == 0, f"probe failed:\nSTDOUT:\n{proc.stdout}\nSTDERR:\n{proc.stderr}"
    lines = [l for l in proc.stdout.splitlines() if l.startswith("REPORT ")]
    assert len(lines) == 1, proc.stdout
    return json.loads(lines[0][len("REPORT ") :]), proc.stderr


# --------------------------------------------------------------------------
# Installation and autoload
# --------------------------------------------------------------------------


def test_pth_file_is_installed_at_site_packages_root():
    pth = os.path.join(sysconfig.get_paths()["purelib"], "sglang_session_cache.pth")
    assert os.path.isfile(pth), f"{pth} missing: was the package installed with `pip install .`?"
    with open(pth) as f:
        lines = [l.strip() for l in f if l.strip()]
    assert lines == ["import sglang_session_cache._autoload"]


def test_version_matches_distribution_metadata():
    assert sglang_session_cache.__version__ == metadata.version("sglang-session-cache") == "0.1.0"


def test_package_import_is_cheap():
    code = (
        "import sys, sglang_session_cache, sglang_session_cache._autoload; "
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'sglang', 'torch', 'numpy', 'dataclasses', 'sglang_session_cache.patch_table'}); "
        "print(heavy)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=TIMEOUT
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_autoload_patches_fresh_process_without_activate():
    report, _ = _run_probe()
    assert report["autoloaded"] and report["hooked"]
    assert report["marker"] == sglang_session_cache.__version__
    assert MARKER_PATCH in report["applied"]
    assert report["active"] is True
    # the loader wrapper hands the module its real loader back
    assert report["loader"] == "SourceFileLoader"


def _spawn_probe():
    import sys

    imported_before = URC in sys.modules
    import sglang.srt.mem_cache.unified_radix_cache as m

    import sglang_session_cache as ssc

    return {
        "pid": os.getpid(),
        "imported_before": imported_before,
        "marker": getattr(m.UnifiedRadixCache, MARKER_ATTR, None),
        "applied": ssc.applied_patches(),
    }


def test_spawn_child_is_patched():
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        report = pool.apply_async(_spawn_probe).get(timeout=TIMEOUT)
    assert report["pid"] != os.getpid()
    assert report["imported_before"] is False  # a fresh interpreter, nothing inherited
    assert report["marker"] == sglang_session_cache.__version__
    assert MARKER_PATCH in report["applied"]


def test_disable_env_var_turns_autoload_off_but_activate_still_works():
    report, _ = _run_probe("--activate", SGLANG_SESSION_CACHE_DISABLE="1")
    assert report["hooked"] is False
    assert report["marker"] is None
    assert report["applied"] == []
    # an explicit activate() patches the already-imported module
    assert report["activate"] is True
    assert report["marker_after"] == sglang_session_cache.__version__
    assert MARKER_PATCH in report["applied_after"]


# --------------------------------------------------------------------------
# Version guard
# --------------------------------------------------------------------------


def test_version_guard_accepts_exactly_0_5_16():
    assert activation.REQUIRED_SGLANG_VERSION == "0.5.16"
    assert activation.check_sglang_version("0.5.16") is None


def test_version_guard_newer_mentions_native_feature():
    msg = activation.check_sglang_version("0.5.17")
    assert msg is not None
    assert "refusing to activate" in msg
    assert "found sglang 0.5.17" in msg
    assert "sglang==0.5.16 exactly" in msg
    assert "--enable-session-radix-cache" in msg


def test_version_guard_older_names_both_versions_only():
    msg = activation.check_sglang_version("0.5.15")
    assert msg is not None
    assert "found sglang 0.5.15" in msg and "sglang==0.5.16 exactly" in msg
    assert "--enable-session-radix-cache" not in msg


@pytest.mark.parametrize("found", ["0.5.16.post1", "0.5.16rc1", "0.5.16+cu130", "not-a-version"])
def test_version_guard_refuses_near_misses(found):
    msg = activation.check_sglang_version(found)
    assert msg is not None and f"found sglang {found}" in msg
    # Not a newer release: no pointer to a native feature it would not have.
    assert "--enable-session-radix-cache" not in msg
    if "post" in found or "+" in found:
        assert "post-release or local build of 0.5.16" in msg


def test_version_guard_refuses_missing_sglang():
    msg = activation.check_sglang_version(None)
    assert msg is not None and "not installed" in msg and "0.5.16" in msg


def test_wrong_sglang_version_end_to_end():
    report, stderr = _run_probe("--activate", SGLANG_SESSION_CACHE_FAKE_SGLANG_VERSION="0.5.17")
    expected = activation.check_sglang_version("0.5.17")
    assert stderr.count(expected) == 1, stderr  # one warning, even after activate()
    assert report["marker"] is None  # sglang imported fine, ran unpatched
    assert report["applied"] == []
    assert report["active"] is False
    assert report["activate"] is False
    assert report["marker_after"] is None


# --------------------------------------------------------------------------
# Hook mechanics, on throw-away modules
# --------------------------------------------------------------------------


@pytest.fixture
def fake_target(tmp_path, monkeypatch):
    """A module file ``ssc_fake_<id>.py`` registered in the patch table (in place
    of the real entries) with a patch that counts its invocations."""
    tag = uuid.uuid4().hex[:10]
    target, patcher = f"ssc_fake_{tag}", f"ssc_fake_patch_{tag}"
    (tmp_path / f"{target}.py").write_text("class Foo:\n    pass\n")
    (tmp_path / f"{patcher}.py").write_text(
        textwrap.dedent(
            """
            CALLS = []

            def bump(module):
                CALLS.append(module.__name__)
                module.Foo.patched = len(CALLS)

            def boom(module):
                raise RuntimeError("patch exploded")
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(activation, "WATCHED_ROOTS", activation.WATCHED_ROOTS | {target})

    def use(apply="bump", source=None):
        if source is not None:
            (tmp_path / f"{target}.py").write_text(source)
        patch = Patch(
            name=f"test.{target}.{apply}",
            module=target,
            targets=("Foo.patched",),
            apply=f"{patcher}:{apply}",
            why="test",
        )
        monkeypatch.setattr(patch_table, "PATCHES", (patch,))
        return patch

    activation.install_hook()
    yield target, patcher, use
    for name in (target, patcher):
        sys.modules.pop(name, None)


def test_hook_applies_on_import_and_activate_is_idempotent(fake_target):
    target, patcher, use = fake_target
    patch = use()
    module = importlib.import_module(target)
    calls = sys.modules[patcher].CALLS
    assert calls == [target]
    assert module.Foo.patched == 1
    assert type(module.__loader__).__name__ == "SourceFileLoader"
    assert activation.activate() is True
    assert activation.activate() is True
    assert calls == [target]  # nothing applied twice
    assert activation.applied_patches().count(patch.name) == 1


def test_activate_patches_already_imported_module_once(fake_target):
    target, patcher, use = fake_target
    module = importlib.import_module(target)  # not in the table yet: unpatched
    assert not hasattr(module.Foo, "patched")
    patch = use()
    assert activation.activate() is True
    assert activation.activate() is True
    assert sys.modules[patcher].CALLS == [target]
    assert module.Foo.patched == 1
    assert activation.applied_patches().count(patch.name) == 1


def test_install_hook_is_idempotent():
    activation.install_hook()
    activation.install_hook()
    finders = [f for f in sys.meta_path if isinstance(f, activation.SessionCachePatchFinder)]
    assert len(finders) == 1


def test_failing_patch_is_logged_and_reraised(fake_target, caplog):
    target, _, use = fake_target
    patch = use(apply="boom")
    with caplog.at_level(logging.ERROR, logger="sglang_session_cache.activation"):
        with pytest.raises(RuntimeError, match="patch exploded"):
            importlib.import_module(target)
    assert patch.name in caplog.text
    assert target not in sys.modules
    assert patch.name not in activation.applied_patches()


def test_module_import_error_is_not_swallowed(fake_target):
    target, patcher, use = fake_target
    patch = use(source="raise ImportError('the module itself is broken')\n")
    with pytest.raises(ImportError, match="the module itself is broken"):
        importlib.import_module(target)
    assert patcher not in sys.modules  # patch never resolved nor run
    assert patch.name not in activation.applied_patches()


def test_missing_target_module_raises_module_not_found(fake_target, tmp_path):
    target, _, use = fake_target
    use()
    (tmp_path / f"{target}.py").unlink()
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(target)


# --------------------------------------------------------------------------
# Patch table
# --------------------------------------------------------------------------


def test_patch_table_is_well_formed():
    assert PATCHES, "the patch table is empty"
    names = [p.name for p in PATCHES]
    assert len(names) == len(set(names))
    for p in PATCHES:
        assert p.module.split(".")[0] in activation.WATCHED_ROOTS, p
        assert p.targets and all(isinstance(t, str) and t for t in p.targets), p
        assert p.why.strip(), p
        assert callable(patch_table.resolve(p)), p
    assert any(p.name == MARKER_PATCH and p.module == URC for p in PATCHES)


def test_every_patch_applies_in_this_process():
    """The pytest process itself is autoloaded: importing each patched module
    here applies its entries (or activate() does, if it was imported earlier)."""
    for module_name in sorted({p.module for p in PATCHES}):
        importlib.import_module(module_name)
    assert activation.activate() is True
    applied = activation.applied_patches()
    for p in PATCHES:
        assert p.name in applied, p.name
    urc = sys.modules[URC]
    assert getattr(urc.UnifiedRadixCache, MARKER_ATTR) == sglang_session_cache.__version__


def test_patch_table_cli_prints_every_patch():
    out = subprocess.run(
        [sys.executable, "-m", "sglang_session_cache.patch_table"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert out.returncode == 0, out.stderr
    assert "requires sglang==0.5.16" in out.stdout
    for p in PATCHES:
        assert p.name in out.stdout
        assert p.module in out.stdout
        for t in p.targets:
            assert t in out.stdout
            assert " ".join(p.why.split()) in " ".join(out.stdout.split())
