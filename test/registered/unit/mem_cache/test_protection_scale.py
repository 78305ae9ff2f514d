"""``--session-radix-cache-max-protected-fraction auto``: the protection scale
learned from misses on KV that protection pushed out (``protection_scale.py``),
on its own and through the real UnifiedRadixCache."""

import os
import sys
from array import array

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from session_test_utils import SHAPES, prompt, turn  # noqa: E402

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.unified_cache_components import ComponentType  # noqa: E402
from sglang_session_cache.protection_policy import (  # noqa: E402
    AUTO,
    AUTO_FRACTION_CEILING,
    normalize_fraction,
)
from sglang_session_cache.protection_scale import (  # noqa: E402
    EARLY_BOOST,
    EARLY_WINDOW,
    ProtectionScale,
    _common_prefix,
    ghost_key,
)

FULL = ComponentType.FULL


# ---- the scale alone -----------------------------------------------------------------


def settled(capacity: int) -> ProtectionScale:
    """A scale past its early window (EARLY_WINDOW pools of ghost tokens
    recorded before): each miss moves it at its own pace, size / capacity."""
    s = ProtectionScale()
    s.configure(capacity)
    s.ghost_clock = int(EARLY_WINDOW * capacity)
    return s


def test_misses_of_other_traffic_shrink_returning_sessions_grow():
    s = settled(1000)
    s.evicted(parent_id=1, node_id=2, tokens=[5, 6, 7], size=100)
    assert not s.missed(1, [9, 9], returning=False)  # no ghost there
    assert s.missed(1, [5, 6, 7, 8], returning=False)
    assert s.scale == pytest.approx(0.9) and s.shrank == 1
    assert not s.missed(1, [5, 6, 7, 8], returning=False)  # a ghost is used once
    s.evicted(1, 3, [5, 6, 7], 50)
    assert not s.missed(1, [5, 6, 7], returning=True)
    assert s.scale == pytest.approx(0.95) and s.grew == 1
    assert s.validate() is None


def test_a_returning_sessions_miss_fades_with_the_ghosts_age():
    """Protection pays per token held until the session returns: a session
    missing KV evicted long ago would have lost it under plain LRU too."""
    from sglang_session_cache.protection_scale import RETURN_WINDOW

    window = int(RETURN_WINDOW * 1000)
    for evicted_after, grown in ((0, 100), (window // 2, 50), (window, 0), (2 * window, 0)):
        s = settled(1000)
        s.scale = 0.5
        s.evicted(1, 2, [5, 6, 7], 100)
        if evicted_after:
            s.evicted(3, 4, [8], evicted_after)  # other unreferenced KV goes after it
        s.missed(1, [5, 6, 7, 8], returning=True)
        assert s.scale == pytest.approx(0.5 + grown / 1000)
        assert s.grew == (grown > 0) and (1, 5) not in s.ghosts  # used even when it counts 0
    # Other traffic's misses count in full whatever the age: a hot document
    # pushed out is the cost of protection.
    s = settled(1000)
    s.evicted(1, 2, [5, 6, 7], 100)
    s.evicted(3, 4, [8], 2 * window)
    s.missed(1, [5, 6, 7, 8], returning=False)
    assert s.scale == pytest.approx(0.9) and s.shrank == 1


def test_the_scale_moves_faster_while_it_has_seen_little():
    """EARLY_BOOST times its own pace before any ghost, falling linearly to
    its own pace over the first EARLY_WINDOW pools of ghost tokens: a scale
    that starts at full protection reaches what the traffic asks for before
    hot documents pay for long, and then moves no faster than the misses."""
    window = int(EARLY_WINDOW * 1000)
    for seen in (0, window // 2, window, 3 * window):
        s = ProtectionScale()
        s.configure(1000)
        for i in range(seen // 100):  # other unreferenced KV recorded before
            s.evicted(9, 100 + i, [i], 100)
        s.evicted(1, 2, [5, 6, 7], 10)
        boost = 1 + (EARLY_BOOST - 1) * max(0.0, 1 - (seen + 10) / window)
        assert s.early_boost() == pytest.approx(boost)
        s.missed(1, [5, 6, 7, 8], returning=False)
        assert s.scale == pytest.approx(1 - 10 / 1000 * boost)
        # Growing back is boosted alike (the ghost just recorded counts in full).
        s.evicted(1, 3, [5, 6, 7], 10)
        before, boost = s.scale, s.early_boost()
        s.missed(1, [5, 6, 7], returning=True)
        assert s.scale == pytest.approx(min(1.0, before + 10 / 1000 * boost))
        assert s.validate() is None
    assert boost == 1 and s.scale == pytest.approx(1.0)  # past the window: its own pace
    s = ProtectionScale()
    s.configure(1000)
    s.evicted(1, 2, [5] * 300, 300)
    s.missed(1, [5] * 300, returning=False)  # boosted, 300 tokens count for more than the pool
    assert s.scale == 0.0


def test_a_miss_counts_the_whole_evicted_chain():
    s = settled(1000)
    s.evicted(7, 8, [1, 2], 2)  # the leaf went first ...
    s.evicted(1, 7, [9, 9], 2)  # ... then its parent
    s.missed(1, [9, 9, 1, 2], returning=False)
    assert s.scale == pytest.approx(1 - 4 / 1000)
    assert not s.ghosts and s.ghost_tokens == 0


def test_a_request_sharing_only_the_start_of_an_evicted_node_counts_that_start():
    """A one-shot prompt (template + unique body) evicted as one node: the
    next one-shot with the same template lost only the template."""
    s = settled(1000)
    s.evicted(1, 2, list(range(100)), 100)
    s.missed(1, list(range(10)) + [777] * 50, returning=False)
    assert s.scale == pytest.approx(1 - 10 / 1000)


def test_mamba_ghosts_count_up_to_the_deepest_state():
    s = settled(1000)
    s.evicted(7, 8, [3] * 10, 10, state=True, whole_only=True)  # leaf with a state
    s.evicted(1, 7, [2] * 5, 5, state=False, whole_only=True)  # its parent: none
    s.missed(1, [2] * 5 + [3] * 10, returning=False)
    assert s.scale == pytest.approx(1 - 15 / 1000)
    s.evicted(7, 8, [3] * 10, 10, state=True, whole_only=True)
    s.evicted(1, 7, [2] * 5, 5, state=False, whole_only=True)
    s.missed(1, [2] * 5 + [3] * 4 + [9], returning=False)  # leaves the leaf early
    assert s.scale == pytest.approx(1 - 15 / 1000)  # nothing it could reuse


def test_protected_sessions_reusing_their_kv_do_not_move_the_scale():
    # Only misses move it: a protected session's own hits are what protection
    # is for.  Counting them too ("saved: plain LRU would have evicted it")
    # held too much of the pool once one-shot traffic shared hot documents
    # (measured; docs: "Hits do not move the scale").
    h = SHAPES["full"](num_tokens=1024)
    tracker = h.cache.session_ref_tracker
    tracker.configure_protection(AUTO, AUTO)
    policy = tracker.policy
    policy.scale.scale = 0.5
    policy._apply_limits()
    conv = prompt(10_000, 60)
    turn(h, conv, "s")
    conv = conv + prompt(20_000, 10)
    turn(h, conv, "s")  # returned: protected
    for i in range(20):  # more than a pool of unreferenced KV goes by
        turn(h, prompt(100_000 + 1000 * i, 150))
    before = h.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", conv))))
    assert len(before.device_indices) == len(conv)  # protection kept it
    turn(h, conv + prompt(30_000, 10), "s")
    assert policy.scale.scale == 0.5 and policy.scale.grew == 0
    h.cache.validate_session_state()


def test_ghosts_are_bounded_by_the_pool_and_clamped():
    s = ProtectionScale()
    s.configure(100)
    for i in range(50):
        s.evicted(0, i + 1, [i], 10)
    assert s.ghost_tokens <= 100 and len(s.ghosts) == 10
    for i in range(40, 50):
        s.missed(0, [i], returning=False)
    assert s.scale == pytest.approx(0.0)
    assert s.validate() is None


def test_missed_reads_the_unmatched_rest_in_place():
    """``missed(tokens, start=, end=)`` (what a match passes: no copy of the
    prompt's rest) learns exactly what ``missed`` of that slice learns, for
    page 1 and page 2, chains, early exits and a rest cut mid-page."""
    import copy
    import random

    rng = random.Random(7)
    for page in (1, 2):
        for _ in range(300):
            s = ProtectionScale(page=page)
            s.configure(1000)
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 24))]
            start = rng.randrange(len(tokens))
            end = rng.randrange(start, len(tokens) + 2)
            pid, at = 1, start
            while at < len(tokens) and rng.random() < 0.8:  # an evicted chain
                size = page * rng.randrange(1, 4)
                head = tokens[at:at + size]
                if rng.random() < 0.2:
                    head = head[:-1] + [9]  # the request leaves this node early
                s.evicted(pid, pid + 1, head, size, state=rng.random() < 0.7,
                          whole_only=rng.random() < 0.3)
                pid, at = pid + 1, at + size
            sliced = copy.deepcopy(s)
            returning = rng.random() < 0.5
            assert s.missed(1, tokens, returning, start, end) == sliced.missed(
                1, tokens[start:end], returning)
            assert (s.scale, s.ghost_tokens, list(s.ghosts)) == (
                sliced.scale, sliced.ghost_tokens, list(sliced.ghosts))


def test_fixed_fraction_learns_nothing():
    s = ProtectionScale()
    s.configure(None)
    s.evicted(0, 1, [1], 10)
    assert not s.ghosts and not s.missed(0, [1], returning=False)


def test_option_values():
    assert normalize_fraction("auto") == AUTO
    assert normalize_fraction(None) == AUTO  # the default
    assert normalize_fraction("0.5") == 0.5


# ---- on the real cache -----------------------------------------------------------------


def _idle_sessions_and_hot_documents(h, page: int = 1):
    """``page``: lengths rounded up to whole pages (a paged tree keys and
    evicts whole pages, so a document's end falls on a node boundary)."""
    tracker = h.cache.session_ref_tracker
    tail, doc = -(-10 // page) * page, -(-150 // page) * page
    for i in range(8):  # sessions that return once, then never close
        conv = prompt(10_000 * (i + 1), 60)
        turn(h, conv, f"s{i}")
        turn(h, conv + prompt(10_000 * (i + 1) + 500, tail), f"s{i}")
    docs = [prompt(900_000 + 10_000 * d, doc) for d in range(3)]
    for i in range(120):  # untagged one-shots over three shared documents
        turn(h, docs[i % 3] + prompt(1_000_000 + 10 * i, 4))
    return tracker


# FULL+SWA is left out: at this size its SWA pool runs out first, so the
# documents lose their SWA window (the match stops there), not their FULL KV,
# and no FULL ghost is left.
def test_hot_shared_documents_shrink_protection_under_auto():
    h = SHAPES["full"](num_tokens=1024)
    h.cache.session_ref_tracker.configure_protection(AUTO, AUTO)
    tracker = _idle_sessions_and_hot_documents(h)
    policy = tracker.policy
    assert policy.scale.shrank > 0 and policy.scale.scale < 1.0
    assert policy.effective_fraction == pytest.approx(AUTO_FRACTION_CEILING * policy.scale.scale)
    assert tracker.components[FULL].ref_units <= policy.limits[FULL]
    snap = h.cache.session_metrics()
    assert snap["effective_protected_fraction"] == policy.effective_fraction
    assert snap["protection_scale_shrank"] == policy.scale.shrank
    h.cache.validate_session_state()
    h.check()


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_match_reaches_the_scale_only_where_a_ghost_is(page_size):
    """The scheduler-match hook looks up the ghost where the match stopped
    before anything else: the scale sees only matches that stop at a ghost,
    and still learns from them (page 1 and a paged tree)."""
    h = SHAPES["full"](num_tokens=1024, page_size=page_size)
    tracker = h.cache.session_ref_tracker
    tracker.configure_protection(AUTO, AUTO)
    policy = tracker.policy
    calls = []
    original = policy.on_ghost_miss

    def spy(parent_id, tokens, returning, components, start=0, end=None, extra_key=None):
        key = ghost_key(parent_id, tokens, policy.scale.page, start, extra_key)
        calls.append(key in policy.scale.ghosts)
        return original(parent_id, tokens, returning, components, start, end, extra_key)

    policy.on_ghost_miss = spy
    _idle_sessions_and_hot_documents(h, page_size)
    assert calls and all(calls)
    assert policy.scale.shrank > 0 and policy.scale.scale < 1.0
    h.cache.validate_session_state()
    h.check()


def test_mamba_counts_only_what_a_match_could_have_ended_on():
    """SGLang 0.5.16 keeps Mamba states only where an insert ended, so a
    one-shot cannot reuse a shared document's node (no state at its end):
    losing it costs nothing and does not shrink the scale."""
    h = SHAPES["swa_mamba"](num_tokens=1024)
    h.cache.session_ref_tracker.configure_protection(AUTO, AUTO)
    tracker = _idle_sessions_and_hot_documents(h)
    assert tracker.policy.scale.shrank == 0 and tracker.policy.scale.scale == 1.0
    h.cache.validate_session_state()


def test_fixed_fraction_keeps_its_bound():
    h = SHAPES["full"](num_tokens=1024)
    h.cache.session_ref_tracker.configure_protection(0.9, AUTO)
    tracker = _idle_sessions_and_hot_documents(h)
    assert tracker.policy.scale.scale == 1.0 and not tracker.policy.scale.ghosts
    assert tracker.policy.effective_fraction == 0.9
    h.cache.validate_session_state()


def test_scale_decisions_follow_events_not_clocks():
    outcomes = []
    for offset in (0.0, 4242.0):
        h = SHAPES["full"](num_tokens=1024)
        tracker = h.cache.session_ref_tracker
        tracker.clock = lambda offset=offset: offset
        tracker.configure_protection(AUTO, AUTO)
        _idle_sessions_and_hot_documents(h)
        outcomes.append((tracker.policy.scale.scale, tracker.policy.scale.shrank,
                         sorted(s for s in tracker.open_sessions()
                                if tracker.session_leaves(s, FULL))))
    assert outcomes[0] == outcomes[1]


def test_common_prefix_agrees_with_a_token_by_token_scan():
    import random
    from array import array

    rng = random.Random(0)
    for _ in range(500):
        a = array("q", (rng.randint(0, 2) for _ in range(rng.randint(0, 40))))
        b = array("q", (rng.randint(0, 2) for _ in range(rng.randint(0, 40))))
        n = min(len(a), len(b))
        want = next((i for i in range(n) if a[i] != b[i]), n)
        assert _common_prefix(a, b) == want
        assert _common_prefix(list(a), b) == want  # mixed types: the scan


@pytest.mark.parametrize("namespace", ["A", "B", None])
def test_a_ghost_is_missed_only_from_its_own_namespace(namespace):
    """The tree keys children by namespace (LoRA id, cache salt) and first
    page: a request in another namespace never could have reused an evicted
    node, so it leaves its ghost alone and the scale unmoved."""
    h = SHAPES["full"](num_tokens=256)
    tracker = h.cache.session_ref_tracker
    tracker.configure_protection(AUTO, AUTO)
    scale = tracker.policy.scale
    turn(h, prompt(50_000, 40), "s")  # a protected session: ghosts are kept
    doc = prompt(1_000, 100)
    req = h.new_req(doc, extra_key="A")
    h.prefill(req, finishing=True)
    h.finish(req)
    h.evict(num_tokens=100)  # the unreferenced document goes first
    assert len(scale.ghosts) == 1
    req = h.new_req(doc + [7, 7], extra_key=namespace)
    assert h.prefill(req, finishing=True) == 0  # nothing cached to reuse
    h.finish(req)
    own = namespace == "A"
    assert (scale.shrank == 1) is own and (scale.scale < 1.0) is own
    assert len(scale.ghosts) == (0 if own else 1)
    h.cache.validate_session_state()
    h.check()


def test_a_returning_session_grows_the_scale_back_with_nothing_referenced():
    """Once the bound fits no session's path, every registration is
    withdrawn at once and nothing stays referenced; a returning session that
    misses its own evicted KV must still be able to grow the scale."""
    h = SHAPES["full"](num_tokens=1024)
    tracker = h.cache.session_ref_tracker
    tracker.configure_protection(AUTO, AUTO)
    policy = tracker.policy
    policy.scale.scale = 0.4
    policy._apply_limits()  # 368 tokens: less than the session's path
    conv = prompt(50_000, 400)
    turn(h, conv, "c")
    conv = conv + [1, 2, 3, 4]
    turn(h, conv, "c")  # returned; withdrawn at once (over the bound)
    assert tracker.components[FULL].ref_units == 0
    for i in range(6):  # untagged traffic evicts the session's KV
        turn(h, prompt(2_000_000 + 1000 * i, 110))
    req = turn(h, conv + [7, 8], "c")  # back: misses its own KV
    assert req.matched_prefix_len == 0
    assert policy.scale.grew == 1 and policy.scale.scale > 0.4
    h.cache.validate_session_state()
    h.check()


def test_a_miss_on_kv_protection_did_not_push_out_does_not_shrink():
    s = ProtectionScale()
    s.configure(1000)
    s.scale = 0.5
    s.evicted(1, 2, [5, 6, 7], 100, pushed_out=False)  # nothing was referenced
    assert not s.missed(1, [5, 6, 7, 8], returning=False)
    assert s.scale == 0.5 and s.shrank == 0 and not s.ghosts  # used up all the same
    s.evicted(1, 2, [5, 6, 7], 100, pushed_out=False)
    s.missed(1, [5, 6, 7, 8], returning=True)  # but it would have been kept
    assert s.grew == 1 and s.scale > 0.5
