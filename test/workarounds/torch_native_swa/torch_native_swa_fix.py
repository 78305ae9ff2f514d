"""Test-only workaround for an sglang 0.5.16 bug in the torch_native backend.

``TorchNativeAttnBackend`` passes ``req_to_token`` (full-pool slot indices) to
its SDPA loops for every layer, but for a sliding-window layer of a hybrid SWA
pool ``get_key_buffer`` returns the SWA pool's buffer, whose slots are
different (and fewer). Here, for SWA layers only, the rows the batch reads are
translated to SWA slots with the pool's own ``translate_loc_from_full_to_swa``
before the loop runs. Full-attention layers and non-hybrid pools are untouched.
"""

import importlib.abc
import importlib.util
import sys

TARGET = "sglang.srt.layers.attention.torch_native_backend"
_MARK = "_session_cache_test_swa_fix"


def _is_swa_layer(backend, layer) -> bool:
    if not getattr(backend, "use_sliding_window_kv_pool", False):
        return False
    mapping = getattr(backend.token_to_kv_pool, "layers_mapping", None)
    return bool(mapping and mapping[layer.layer_id][1])


def _swa_rows(backend, req_to_token, req_pool_indices, seq_lens, encoder_lens):
    import torch

    ends = seq_lens if encoder_lens is None else seq_lens + encoder_lens
    width = int(ends.max().item()) if ends.numel() else 0
    rows = req_to_token[req_pool_indices, :width]
    swa = backend.token_to_kv_pool.translate_loc_from_full_to_swa(rows.reshape(-1))
    arange = torch.arange(rows.shape[0], device=rows.device, dtype=req_pool_indices.dtype)
    return swa.reshape(rows.shape), arange


def _wrap_forward(orig):
    def forward(self, q, k, v, layer, forward_batch, *args, **kwargs):
        self._swa_fix_layer = _is_swa_layer(self, layer)
        try:
            return orig(self, q, k, v, layer, forward_batch, *args, **kwargs)
        finally:
            self._swa_fix_layer = False

    return forward


def _wrap_extend(orig):
    def run(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
            seq_lens, extend_prefix_lens, extend_seq_lens, encoder_lens=None, *a, **kw):
        if getattr(self, "_swa_fix_layer", False):
            req_to_token, req_pool_indices = _swa_rows(
                self, req_to_token, req_pool_indices, seq_lens, encoder_lens)
        return orig(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                    seq_lens, extend_prefix_lens, extend_seq_lens, encoder_lens, *a, **kw)

    return run


def _wrap_decode(orig):
    def run(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
            seq_lens, encoder_lens=None, *a, **kw):
        if getattr(self, "_swa_fix_layer", False):
            req_to_token, req_pool_indices = _swa_rows(
                self, req_to_token, req_pool_indices, seq_lens, encoder_lens)
        return orig(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                    seq_lens, encoder_lens, *a, **kw)

    return run


def apply(module) -> None:
    cls = module.TorchNativeAttnBackend
    if getattr(cls, _MARK, False):
        return
    cls.forward_extend = _wrap_forward(cls.forward_extend)
    cls.forward_decode = _wrap_forward(cls.forward_decode)
    cls._run_sdpa_forward_extend = _wrap_extend(cls._run_sdpa_forward_extend)
    cls._run_sdpa_forward_decode = _wrap_decode(cls._run_sdpa_forward_decode)
    setattr(cls, _MARK, True)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        apply(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # find the real spec, once
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install_import_hook() -> None:
    if TARGET in sys.modules:
        apply(sys.modules[TARGET])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
