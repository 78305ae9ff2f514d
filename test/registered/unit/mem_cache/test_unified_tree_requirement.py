"""--enable-session-radix-cache fails fast at ServerArgs validation when the
server would not build the unified tree (issue 11 item 3), on real ServerArgs
built from real (tiny, local) model configs."""

import pytest

from sglang.srt.environ import envs
from sglang.srt.server_args import ServerArgs

from sglang_session_cache_bench.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.getbasetemp().parent / "tiny_models"
    return {k: str(build_tiny_model(k, root)) for k in ("llama", "mellum")}


def _args(model, **kw):
    return ServerArgs(model_path=model, device="cpu", attention_backend="torch_native",
                      disable_cuda_graph=True, max_total_tokens=4096, **kw)


@pytest.fixture
def unified_env(monkeypatch):
    def set_(on):
        if on:
            monkeypatch.setenv("SGLANG_ENABLE_UNIFIED_RADIX_TREE", "1")
        else:
            monkeypatch.delenv("SGLANG_ENABLE_UNIFIED_RADIX_TREE", raising=False)
        assert envs.SGLANG_ENABLE_UNIFIED_RADIX_TREE.get() is on

    return set_


def test_full_only_model_without_unified_tree_fails_fast(models, unified_env):
    unified_env(False)
    with pytest.raises(ValueError, match="needs the unified radix tree") as e:
        _args(models["llama"], enable_session_radix_cache=True)
    assert "SGLANG_ENABLE_UNIFIED_RADIX_TREE=1" in str(e.value)


def test_flag_off_or_unified_env_set_is_accepted(models, unified_env):
    unified_env(False)
    assert _args(models["llama"]).enable_session_radix_cache is False
    unified_env(True)
    assert _args(models["llama"], enable_session_radix_cache=True).enable_session_radix_cache


def test_hybrid_swa_model_gets_the_unified_tree_without_the_env_var(models, unified_env):
    # SGLang builds UnifiedRadixCache for hybrid SWA models anyway: failing here
    # would be wrong (the scheduler-side check still guards the built cache).
    unified_env(False)
    assert _args(models["mellum"], enable_session_radix_cache=True).enable_session_radix_cache


def test_disabled_radix_cache_always_fails(models, unified_env):
    unified_env(True)
    with pytest.raises(ValueError, match="--disable-radix-cache"):
        _args(models["llama"], enable_session_radix_cache=True, disable_radix_cache=True)
