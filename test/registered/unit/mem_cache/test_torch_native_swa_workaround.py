"""The test-only torch_native SWA-index workaround (test/workarounds/) on a
real SWAKVPool + SWATokenToKVPoolAllocator: SWA layers read SWA slots
translated from the rows' full-pool slots; full layers are left alone."""

import os
import sys
from types import SimpleNamespace

import torch

from cache_fixtures import make_swa_cache

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..",
                                "workarounds", "torch_native_swa"))
import torch_native_swa_fix  # noqa: E402

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402


def _backend(h):
    backend = object.__new__(TorchNativeAttnBackend)  # only the pool fields are read
    backend.token_to_kv_pool = h.kv_pool
    backend.use_sliding_window_kv_pool = True
    return backend


def test_swa_rows_are_translated_and_fit_the_swa_pool():
    h = make_swa_cache(num_tokens=256, swa_num_tokens=96, page_size=1, sliding_window_size=8)
    # Fill the full pool unevenly so full slots and SWA slots differ.
    first = h.new_req(list(range(100, 180)))
    h.prefill(first, finishing=True)
    h.finish(first)
    req = h.new_req(list(range(10, 50)))
    h.prefill(req)
    table = h.req_to_token_pool.req_to_token
    full_row = table[req.req_pool_idx, :40]
    rows, idx = torch_native_swa_fix._swa_rows(
        _backend(h), table, torch.tensor([req.req_pool_idx]), torch.tensor([40]), None)
    expected = h.allocator.translate_loc_from_full_to_swa(full_row)
    assert torch.equal(rows[0, :40], expected)
    assert idx.tolist() == [0]
    swa_buffer_len = h.kv_pool.swa_kv_pool.k_buffer[0].shape[0]
    assert int(full_row.max()) >= swa_buffer_len  # the upstream read would be out of range
    assert int(rows.max()) < swa_buffer_len


def test_only_swa_layers_take_the_fix():
    h = make_swa_cache(num_tokens=64, page_size=1)
    backend = _backend(h)
    assert torch_native_swa_fix._is_swa_layer(backend, SimpleNamespace(layer_id=0))
    assert not torch_native_swa_fix._is_swa_layer(backend, SimpleNamespace(layer_id=1))
    backend.use_sliding_window_kv_pool = False
    assert not torch_native_swa_fix._is_swa_layer(backend, SimpleNamespace(layer_id=0))
