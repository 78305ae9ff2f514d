"""HiCache host tier with Mamba (issue 12 item 7), on the real cache's
demotion and host-eviction paths (``_evict_device_leaf`` -> ``_evict_to_host``,
``evict_host`` -> the Mamba host LRU walk -> ``_evict_host_leaf``).

What cannot run here: SGLang's host controller.  ``HiCacheController`` /
``HybridCacheController.__init__`` create ``device_module.Stream()`` (write
and load streams; ``get_device_module()`` is ``torch.cuda`` on this build),
which raises without a CUDA driver, so ``write_backup`` cannot copy KV to a
host pool on CPU.  These tests therefore start where a finished write-back
leaves a node — FULL and Mamba ``host_value`` set to host slot indices — and
drive everything after it through SGLang's own code.  The cache has no host
pools attached, so the components' host frees are skipped (their ``None``
checks), exactly as SGLang's code allows."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from cache_fixtures import make_full_mamba_cache  # noqa: E402

from sglang.srt.mem_cache.unified_cache_components import ComponentType  # noqa: E402

FULL, MAMBA = ComponentType.FULL, ComponentType.MAMBA

_next_host_slot = [0]


def _as_written_back(node):
    """The state ``write_backup`` + its ack leave on ``node``: host copies of
    the FULL KV and the Mamba state."""
    n = len(node.key)
    start = _next_host_slot[0]
    _next_host_slot[0] += n + 1
    node.component_data[FULL].host_value = torch.arange(start, start + n, dtype=torch.int64)
    node.component_data[MAMBA].host_value = torch.tensor([start + n], dtype=torch.int64)


def _leaf(h, tokens):
    """The deepest node on ``tokens``' branch (the request's insert may have
    added its output token below the prompt)."""
    node = h.cache.root_node
    while node.children:
        nxt = [c for c in node.children.values() if c.key.token_ids[0] == tokens[0]] \
            if node is h.cache.root_node else list(node.children.values())
        if len(nxt) != 1:
            break
        node = nxt[0]
    return node


def _demote(h, node):
    """Evict ``node``'s device data through SGLang's D-leaf path (a backed-up
    leaf is demoted to host, not deleted)."""
    tracker = {ct: 0 for ct in h.cache.tree_components}
    assert node in h.cache.evictable_device_leaves
    h.cache._evict_device_leaf(node, tracker)
    assert node.component_data[FULL].value is None
    assert node.component_data[MAMBA].value is None
    assert node in h.cache.evictable_host_leaves


def test_demoting_a_session_leaf_to_host_keeps_its_mamba_reference():
    h = make_full_mamba_cache(enable_session=True, num_tokens=512, mamba_num_slots=8)
    req = h.run_request(list(range(1, 33)), session_id="s", n_decode=3)
    t = h.cache.session_ref_tracker
    (leaf,) = t.session_leaves("s", FULL)
    assert t.session_leaves("s", MAMBA) == {leaf}
    _as_written_back(leaf)
    _demote(h, leaf)
    # The state lives on in host memory and can be loaded back: still referenced.
    assert t.session_leaves("s", MAMBA) == {leaf}
    assert leaf.component_data[MAMBA].session_ref == 1
    host_lru = h.cache.host_lru_lists[MAMBA]
    assert host_lru.in_list(leaf) and host_lru.is_referenced(leaf)
    h.cache.validate_session_state()
    # Once the host copy goes too, the reference leaves the node.
    h.cache.evict_host(1, MAMBA)
    assert leaf not in t.session_leaves("s", MAMBA)
    h.cache.validate_session_state()
    assert req.session_id == "s"


def test_host_mamba_eviction_takes_the_unreferenced_leaf_first():
    h = make_full_mamba_cache(enable_session=True, num_tokens=512, mamba_num_slots=8)
    ref_tokens = [7] * 8 + list(range(100, 124))
    other_tokens = [9] * 8 + list(range(200, 224))
    h.run_request(ref_tokens, session_id="s")       # older: host LRU end
    h.run_request(other_tokens)                      # newer, no session
    t = h.cache.session_ref_tracker
    (ref_leaf,) = t.session_leaves("s", FULL)
    other = _leaf(h, other_tokens)
    assert other is not None and other is not ref_leaf
    for node in (ref_leaf, other):
        _as_written_back(node)
        _demote(h, node)
    h.cache.validate_session_state()
    freed = h.cache.evict_host(1, MAMBA)
    assert freed == 1
    # The unreferenced H-leaf went (whole); the session's host leaf is intact.
    assert other.parent is None or other not in other.parent.children.values()
    assert ref_leaf.component_data[FULL].host_value is not None
    assert ref_leaf in h.cache.evictable_host_leaves
    assert t.session_leaves("s", FULL) == {ref_leaf}
    h.cache.validate_session_state()


def test_host_walk_skips_an_unreferenced_state_whose_eviction_drops_referenced_full():
    """Cascade protection on the host walk: a host leaf whose Mamba state is
    unreferenced but whose FULL path is referenced is skipped while another
    candidate exists; with nothing else left it still goes (soft)."""
    h = make_full_mamba_cache(enable_session=True, num_tokens=512, mamba_num_slots=8)
    ref_tokens = [7] * 8 + list(range(100, 124))
    other_tokens = [9] * 8 + list(range(200, 224))
    h.run_request(ref_tokens, session_id="s")
    h.run_request(other_tokens)
    t = h.cache.session_ref_tracker
    (ref_leaf,) = t.session_leaves("s", FULL)
    other = _leaf(h, other_tokens)
    for node in (ref_leaf, other):
        _as_written_back(node)
        _demote(h, node)
    # Only the Mamba reference goes (FULL keeps protecting the path).
    t.components[MAMBA].drop_session_leaf("s", ref_leaf)
    assert ref_leaf.component_data[MAMBA].session_ref == 0
    assert ref_leaf.full_session_ref == 1
    # Make the referenced leaf the LRU end of the host Mamba list.
    host_lru = h.cache.host_lru_lists[MAMBA]
    host_lru.remove_node(ref_leaf)
    host_lru.insert_mru(ref_leaf)
    host_lru.remove_node(other)
    host_lru.insert_mru(other)
    h.cache.validate_session_state()
    assert h.cache.evict_host(1, MAMBA) == 1
    assert ref_leaf in h.cache.evictable_host_leaves  # skipped: FULL referenced
    assert other not in h.cache.evictable_host_leaves
    # Nothing else left: soft protection lets it go.
    assert h.cache.evict_host(1, MAMBA) == 1
    assert ref_leaf not in h.cache.evictable_host_leaves
    h.cache.validate_session_state()
