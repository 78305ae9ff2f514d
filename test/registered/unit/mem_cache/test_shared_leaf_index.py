"""SWA reads FULL's leaf index (``ComponentSessionRefs.follow``) instead of
keeping its own.  The same operations on two real caches, one with the shared
index (the default) and one with an index per component
(``share_leaf_index=False``, the layout before), must leave every node with
the same counts in every component, the same session leaves, and the same
tree; both are checked by the exact validator after every step."""

import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from cache_fixtures import make_swa_cache, make_swa_mamba_cache  # noqa: E402
from session_test_utils import separate_leaf_indexes  # noqa: E402

from sglang.srt.mem_cache.unified_cache_components import ComponentType  # noqa: E402

FULL, SWA = ComponentType.FULL, ComponentType.SWA

SHAPES = {
    "swa": lambda: make_swa_cache(
        enable_session=True, num_tokens=320, swa_num_tokens=160, page_size=1,
        sliding_window_size=8,
    ),
    "swa_mamba": lambda: make_swa_mamba_cache(
        enable_session=True, num_tokens=320, swa_num_tokens=160, mamba_num_slots=20,
        page_size=1, sliding_window_size=8,
    ),
}


def _path(node) -> tuple:
    parts = []
    while node.parent is not None:
        parts.append(tuple(node.key.token_ids))
        node = node.parent
    return tuple(reversed(parts))


def _state(h) -> dict:
    """Per node (by token path): which components hold data, and their
    session counts; per session: its FULL and SWA leaves (by path)."""
    nodes = {}
    for n in h.tree_nodes():
        nodes[_path(n)] = tuple(
            (ct, cd.value is not None, cd.session_ref)
            for ct, cd in enumerate(n.component_data)
        )
    tracker = h.cache.session_ref_tracker
    leaves = {
        (sid, ct): sorted(_path(n) for n in tracker.session_leaves(sid, ct))
        for sid in tracker.open_sessions()
        for ct in (FULL, SWA)
    }
    return {"nodes": nodes, "leaves": leaves}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_shared_index_matches_an_index_per_component(shape):
    shared = SHAPES[shape]()
    separate = separate_leaf_indexes(SHAPES[shape]())
    assert shared.cache.session_ref_tracker.components[SWA].index_owner is not None
    assert separate.cache.session_ref_tracker.components[SWA].index_owner is None
    rng = random.Random(11)
    convo = {f"s{i}": [900 + i] * 6 for i in range(5)}
    for step in range(300):
        op = rng.random()
        sid = rng.choice(list(convo))
        if op < 0.55:  # the session's next turn (or a branch off its start)
            prompt = convo[sid] if rng.random() < 0.8 else convo[sid][:6]
            prompt = prompt + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
            # The same output on both (the harness's own output ids are
            # process-wide fresh numbers).
            out = [rng.randrange(50, 100) for _ in range(rng.randrange(3))]
            for h in (shared, separate):
                req = h.run_request(prompt, session_id=sid, n_decode=len(out),
                                    output_ids=out)
            convo[sid] = prompt + out
        elif op < 0.65:  # a one-shot request sharing a session's start
            prompt = convo[sid][:8] + [rng.randrange(50) for _ in range(4)]
            for h in (shared, separate):
                h.run_request(prompt)
        elif op < 0.75:  # close; the conversation goes on as a new session
            for h in (shared, separate):
                h.cache.release_radix_session(sid)
            convo[f"{sid}-{step}"] = convo.pop(sid)
        else:
            n = rng.randrange(1, 48)
            kind = rng.randrange(3 if shape == "swa_mamba" else 2)
            for h in (shared, separate):
                if kind == 0:
                    h.evict(num_tokens=n)
                elif kind == 1:
                    h.evict(swa_num_tokens=n)
                else:
                    h.evict(mamba_num=1 + n % 3)
        for h in (shared, separate):
            h.cache.validate_session_state()
        assert _state(shared) == _state(separate), f"diverged at step {step}"
    # Something was referenced and something was evicted along the way.
    tracker = shared.cache.session_ref_tracker
    assert tracker.counters.registered > 100
    assert sum(tracker.referenced_evictions.values()) > 0
