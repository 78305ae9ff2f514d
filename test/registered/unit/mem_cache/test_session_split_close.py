"""Splits and closes on the real UnifiedRadixCache do no per-session or
per-leaf work: a split never walks a leaf's cover (FULL copies the count, SWA
shifts its per-distance counts), and a close updates each covered node once
per component, however many leaves the session holds.  Counts are checked by
the exact validator (recomputed from the leaf index) after every step."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from session_test_utils import SHAPES  # noqa: E402

from sglang.srt.mem_cache.unified_cache_components import ComponentType  # noqa: E402
from sglang_session_cache_bench import structure_cost  # noqa: E402

FULL, SWA, MAMBA = ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA

PROMPT = list(range(1000, 1064))  # 64 shared tokens


def _forbid_cover_walks(monkeypatch, tracker):
    """Any walk of a leaf's cover during the guarded block fails the test."""

    def boom(*a, **k):
        raise AssertionError("split walked a leaf's cover")

    for refs in tracker.components.values():
        monkeypatch.setattr(refs, "covered", boom)
        if hasattr(refs, "_window"):
            monkeypatch.setattr(refs, "_window", boom)
        monkeypatch.setattr(refs, "_lowest_shared", boom, raising=False)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_split_of_a_node_shared_by_many_sessions_walks_no_leaf(shape, monkeypatch):
    kw = {"num_tokens": 4096, "page_size": 1}
    if shape != "full":
        kw["sliding_window_size"] = 24
    if shape == "swa_mamba":
        kw["mamba_num_slots"] = 48
    h = SHAPES[shape](**kw)
    n = 40
    for i in range(n):
        h.run_request(PROMPT + [5000 + 3 * i, 5001 + 3 * i, 5002 + 3 * i], session_id=f"s{i}")
    h.cache.validate_session_state()
    tracker = h.cache.session_ref_tracker
    before = len(h.tree_nodes())
    with monkeypatch.context() as m:
        _forbid_cover_walks(m, tracker)
        # Matches ending inside the shared node split it, again and again.
        for k in (60, 50, 40, 20):
            h.match_len(PROMPT[:k])
    assert len(h.tree_nodes()) == before + 4
    h.cache.validate_session_state()
    # FULL: every piece of the shared prompt counts all n sessions.
    node = h.cache.root_node
    while node.children:
        node = next(iter(node.children.values())) if len(node.children) == 1 else None
        if node is None:
            break
        assert node.full_session_ref == n
    if shape != "full":
        # SWA: only pieces within the window of the 3-token leaves count.
        refs = tracker.components[SWA]
        window = refs.window
        for piece, per in refs.coverage().items():
            assert piece.component_data[SWA].session_ref == sum(per.values())
        assert all(
            d < window for n_ in h.tree_nodes()
            for d in (n_.component_data[SWA].session_below or {})
        )


def test_swa_split_outside_every_window_leaves_the_upper_part_unreferenced():
    h = SHAPES["swa"](num_tokens=1024, sliding_window_size=8, page_size=1)
    h.run_request(PROMPT + [1, 2, 3], session_id="a")
    h.match_len(PROMPT[:10])  # the upper piece is 54 + 3 tokens above the leaf end
    upper = h.cache.root_node.children[PROMPT[0]] if PROMPT[0] in h.cache.root_node.children \
        else next(iter(h.cache.root_node.children.values()))
    assert upper.component_data[SWA].session_ref == 0
    assert upper.component_data[SWA].session_below is None
    assert upper.full_session_ref == 1
    h.cache.validate_session_state()


def _count_bumps(monkeypatch, refs):
    counter = [0]
    orig = refs._bump

    def bump(node, delta):
        counter[0] += 1
        orig(node, delta)

    monkeypatch.setattr(refs, "_bump", bump)
    return counter


@pytest.mark.parametrize("kind", ["full", "swa_mamba"])
def test_close_of_a_many_leaf_session_updates_each_covered_node_once(kind, monkeypatch):
    turns = 24
    h = structure_cost.build_rerendered_session(kind, turns)
    tracker = h.cache.session_ref_tracker
    assert len(tracker.session_leaves("agent")) == turns  # one branch per turn
    covered = {ct: refs.referenced_nodes() for ct, refs in tracker.components.items()}
    # Leaves x depth would be quadratic in the turns; the union is linear.
    assert len(covered[FULL]) <= 2 * turns + 2
    counters = {ct: _count_bumps(monkeypatch, refs) for ct, refs in tracker.components.items()}
    assert h.cache.release_radix_session("agent") == turns * len(tracker.components)
    assert counters[FULL][0] == len(covered[FULL])
    if kind != "full":
        assert counters[MAMBA][0] == turns
        # Re-rendered branches do not overlap in the window: once per node.
        assert counters[SWA][0] == len(covered[SWA])
    h.cache.validate_session_state()
    assert all(n.component_data[ct].session_ref == 0
               for n in h.tree_nodes() for ct in h.cache.tree_components)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_drop_one_leaf_keeps_the_other_branches(shape):
    h = SHAPES[shape](num_tokens=1024, page_size=1)
    h.run_request(PROMPT + [1, 2, 3, 4], session_id="s")
    h.run_request(PROMPT + [7, 8, 9, 10], session_id="s")
    tracker = h.cache.session_ref_tracker
    leaves = tracker.session_leaves("s")
    assert len(leaves) == 2
    first, second = sorted(leaves, key=lambda n: n.id)
    for refs in tracker.index_owners:  # SWA's follows FULL's
        assert refs.drop_session_leaf("s", first) is True
        assert refs.drop_session_leaf("s", first) is False
    h.cache.validate_session_state()
    assert tracker.session_leaves("s") == {second}
    assert first.full_session_ref == 0
    # The shared prompt is still covered by the remaining branch.
    assert second.parent.full_session_ref == 1
    h.cache.release_radix_session("s")
    h.cache.validate_session_state()


def test_registration_under_an_ancestor_leaf_of_another_branch():
    """A new leaf whose path meets another branch of the same session below
    an older leaf counts only the part nobody in the session covered yet."""
    h = SHAPES["full"](num_tokens=1024)
    h.run_request(PROMPT, session_id="s")
    h.run_request(PROMPT + [1, 2, 3, 4], session_id="s")   # extends: subsumes
    h.run_request(PROMPT + [1, 2, 9, 9], session_id="s")   # branch off the first
    h.cache.validate_session_state()
    tracker = h.cache.session_ref_tracker
    assert len(tracker.session_leaves("s")) == 2
    for n in h.tree_nodes():
        assert n.full_session_ref in (0, 1)
    h.run_request(PROMPT + [1, 2], session_id="s")  # an ancestor of both
    h.cache.validate_session_state()
    assert all(n.full_session_ref in (0, 1) for n in h.tree_nodes())


def test_structure_cost_benchmark_smoke(capsys, tmp_path):
    out = tmp_path / "rows.json"
    assert structure_cost.main(
        ["--sessions", "20", "--turns", "6", "--splits", "4", "--json", str(out)]
    ) == 0
    text = capsys.readouterr().out
    assert "worst split on/off" in text and "Session close" in text
    rows = __import__("json").loads(out.read_text())
    assert {(r["component"], r["n"]) for r in rows["split"]} == {("full", 20), ("swa", 20)}
    for r in rows["close"]:
        assert r["leaves"] == 6
        full = r["per_component"]["full"]
        assert full["updates"] == full["covered"]
