"""Earned protection and the protection bound on the real UnifiedRadixCache
(``protection_policy.py``): single-shot sessions reference nothing, returning
sessions do; referenced data never holds more than the configured share of a
pool past a registration, withdrawn least recently registered first."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from session_test_utils import SHAPES, prompt, turn  # noqa: E402

from sglang.srt.mem_cache.unified_cache_components import ComponentType  # noqa: E402
from sglang_session_cache.component_refs import SessionStateError  # noqa: E402
from sglang_session_cache.protection_policy import (  # noqa: E402
    DEFAULT_MAX_PROTECTED_FRACTION,
    DEFAULT_PROTECT_FROM_TURN,
    ProtectionOptionError,
    component_capacity,
    normalize_fraction,
    normalize_from_turn,
)

FULL = ComponentType.FULL


@pytest.fixture(params=list(SHAPES))
def h(request):
    harness = SHAPES[request.param](num_tokens=512)
    yield harness
    harness.cache.validate_session_state()
    harness.check()


def leaves(h, sid):
    return h.cache.session_ref_tracker.session_leaves(sid, FULL)


# ---- earned protection -------------------------------------------------------------


def test_first_request_references_nothing_second_does(h):
    tracker = h.cache.session_ref_tracker
    tracker.configure_protection(1.0, 2)
    p1 = prompt(0, 40)
    turn(h, p1, "a")
    assert leaves(h, "a") == set()
    assert tracker.components[FULL].ref_units == 0
    assert tracker.policy.unearned_finishes == 1
    assert "a" in tracker.open_sessions()  # still open: TTL/close work as before
    turn(h, p1 + prompt(100, 20), "a")
    assert len(leaves(h, "a")) == 1
    # The returning session's newest turn covers the whole conversation.
    assert tracker.components[FULL].ref_units == 60
    h.cache.validate_session_state()


def test_single_shot_sessions_never_displace_other_kv():
    """Tagged one-shots under earned protection evict like untagged traffic:
    a returning session's prefix outlives them; the one-shots' own KV goes."""
    h = SHAPES["full"](num_tokens=200)
    tracker = h.cache.session_ref_tracker
    tracker.configure_protection(1.0, 2)
    conv = prompt(0, 40)
    turn(h, conv, "agent")
    conv = conv + prompt(1000, 20)
    turn(h, conv, "agent")  # returned: protected
    for i in range(12):
        turn(h, prompt(10_000 + 100 * i, 40), f"oneshot-{i}")
    assert all(not leaves(h, f"oneshot-{i}") for i in range(12))
    assert h.match_len(conv) == len(conv)
    h.cache.validate_session_state()


def test_classic_mode_references_the_first_request():
    h = SHAPES["full"]()
    tracker = h.cache.session_ref_tracker
    tracker.configure_protection(1.0, 1)
    turn(h, prompt(0, 30), "a")
    assert len(leaves(h, "a")) == 1


def test_reopened_session_must_earn_again():
    h = SHAPES["full"]()
    tracker = h.cache.session_ref_tracker
    tracker.configure_protection(1.0, 2)
    p = prompt(0, 30)
    turn(h, p, "a")
    turn(h, p + prompt(200, 10), "a")
    assert leaves(h, "a")
    h.cache.release_radix_session("a")
    turn(h, p + prompt(300, 10), "a")  # new generation, first request
    assert not leaves(h, "a")
    h.cache.validate_session_state()


def _returned_then_lapsed(h, sid="a", ttl=30.0):
    """A session that earned protection (two requests), then expired."""
    tracker = h.cache.session_ref_tracker
    tracker.configure_protection(1.0, 2)
    tracker.set_ttl(ttl)
    h.cache.advance_session_clock(0.0)
    p = prompt(0, 30)
    turn(h, p, sid)
    p = p + prompt(200, 10)
    turn(h, p, sid)
    assert leaves(h, sid)
    assert h.cache.advance_session_clock(ttl + 1) == 1  # the TTL ends it
    assert not leaves(h, sid) and sid not in tracker.open_sessions()
    return tracker, p


def test_a_session_that_lapsed_comes_back_as_returning():
    """Expired by the TTL without a close, a session that comes back with
    the same id goes on with its request count: protected at once, and its
    misses count as a returning session's."""
    h = SHAPES["full"]()
    tracker, p = _returned_then_lapsed(h)
    assert tracker.policy.lapsed == {"a": 2}
    turn(h, p + prompt(300, 10), "a")  # reopened: its third request
    assert leaves(h, "a")
    assert tracker.policy.turns["a"] == 3 and "a" not in tracker.policy.lapsed
    assert tracker.counters.expired == 1 and tracker.counters.opened == 2
    h.cache.validate_session_state()


def test_a_lapsed_session_closed_afterwards_must_earn_again():
    """A close after the lapse ends the conversation: the id starts over."""
    h = SHAPES["full"]()
    tracker, p = _returned_then_lapsed(h)
    assert h.cache.release_radix_session("a") == 0
    assert tracker.policy.lapsed == {}
    turn(h, p + prompt(300, 10), "a")
    assert not leaves(h, "a")
    h.cache.validate_session_state()


def test_a_session_released_for_room_keeps_its_count():
    """Released to stay within the open-session bound: it lapsed too."""
    h = SHAPES["full"]()
    tracker = h.cache.session_ref_tracker
    tracker.configure_protection(1.0, 2)
    tracker.max_open_sessions = 2
    p = prompt(0, 30)
    turn(h, p, "a")
    turn(h, p + prompt(200, 10), "a")
    turn(h, prompt(500, 20), "b")
    turn(h, prompt(700, 20), "c")  # room for c: a, the least recent, goes
    assert tracker.counters.evicted_open == 1 and "a" not in tracker.open_sessions()
    assert tracker.policy.lapsed == {"a": 2}
    turn(h, p + prompt(200, 10) + prompt(300, 10), "a")
    assert leaves(h, "a")
    h.cache.validate_session_state()


def test_lapsed_counts_are_bounded_oldest_first(monkeypatch):
    import sglang_session_cache.protection_policy as policy_module

    monkeypatch.setattr(policy_module, "LAPSED_LIMIT", 2)
    h = SHAPES["full"]()
    tracker = h.cache.session_ref_tracker
    tracker.configure_protection(1.0, 2)
    tracker.set_ttl(30.0)
    h.cache.advance_session_clock(0.0)
    for i, sid in enumerate(("a", "b", "c")):
        turn(h, prompt(1000 * i, 20), sid)
    assert h.cache.advance_session_clock(31.0) == 3
    assert list(tracker.policy.lapsed) == ["b", "c"]  # a, the oldest, forgotten
    turn(h, prompt(0, 20) + prompt(5000, 10), "a")  # starts over: not protected
    assert not leaves(h, "a")
    turn(h, prompt(1000, 20) + prompt(6000, 10), "b")  # its second request
    assert leaves(h, "b")
    h.cache.validate_session_state()


def test_validator_catches_a_lapsed_count_for_an_open_session():
    h = SHAPES["full"]()
    tracker = h.cache.session_ref_tracker
    turn(h, prompt(0, 20), "a")
    tracker.policy.lapsed["a"] = 1
    with pytest.raises(SessionStateError, match="lapsed turn counts kept for open sessions"):
        h.cache.validate_session_state()
    del tracker.policy.lapsed["a"]
    h.cache.validate_session_state()


def test_unstamped_finishes_count_as_requests():
    """A request that never went through arrival stamping still counts."""
    h = SHAPES["full"]()
    tracker = h.cache.session_ref_tracker
    tracker.configure_protection(1.0, 2)
    p = prompt(0, 30)
    for extra in (prompt(500, 5), prompt(600, 5)):
        req = h.new_req(p + extra, session_id="u")
        h.prefill(req, finishing=True)
        h.finish(req)
    assert len(leaves(h, "u")) == 1


# ---- the bound ---------------------------------------------------------------------


def test_bound_withdraws_least_recently_registered_first():
    h = SHAPES["full"](num_tokens=256)
    tracker = h.cache.session_ref_tracker
    tracker.configure_protection(0.25, 1)  # at most 64 referenced tokens
    limit = tracker.policy.limits[FULL]
    assert limit == 64
    turn(h, prompt(0, 40), "s1")
    turn(h, prompt(100, 40), "s2")  # 80 > 64: s1 goes
    assert not leaves(h, "s1") and leaves(h, "s2")
    turn(h, prompt(0, 40) + prompt(300, 5), "s1")  # s1 returns: newest now
    assert leaves(h, "s1") and not leaves(h, "s2")
    assert tracker.components[FULL].ref_units <= limit
    assert tracker.policy.withdrawals == 2
    # Withdrawn sessions stay open; their KV stays cached.
    assert set(tracker.open_sessions()) == {"s1", "s2"}
    assert h.match_len(prompt(100, 40)) == 40
    assert h.cache.session_metrics()["protection_withdrawals"] == 2
    h.cache.validate_session_state()


def test_bound_holds_in_every_component_under_churn(h):
    tracker = h.cache.session_ref_tracker
    tracker.configure_protection(0.2, 1)
    for i in range(30):
        sid = f"s{i % 7}"
        base = prompt(10_000 * (i % 7), 30)
        turn(h, base + prompt(100 + i * 3, 3 + i % 5), sid)
        for ct, refs in tracker.components.items():
            limit = tracker.policy.limits[ct]
            assert limit is None or refs.ref_units <= limit, (ct, refs.ref_units, limit)
        h.cache.validate_session_state()
    assert tracker.policy.withdrawals > 0


def test_lowering_the_bound_withdraws_at_once():
    h = SHAPES["full"](num_tokens=256)
    tracker = h.cache.session_ref_tracker
    tracker.configure_protection(1.0, 1)
    for i in range(4):
        turn(h, prompt(100 * i, 30), f"s{i}")
    assert tracker.components[FULL].ref_units == 120
    tracker.configure_protection(0.25, 1)
    assert tracker.components[FULL].ref_units <= 64
    assert leaves(h, "s3") and not leaves(h, "s0")


def test_withdrawal_is_event_ordered_not_clocked():
    """Two ranks with different clocks withdraw the same sessions."""
    results = []
    for offset in (0.0, 12345.0):
        h = SHAPES["full"](num_tokens=256)
        tracker = h.cache.session_ref_tracker
        tracker.clock = lambda offset=offset: offset
        tracker.configure_protection(0.3, 1)
        for i in range(10):
            turn(h, prompt(100 * (i % 5), 25 + i), f"s{i % 5}")
        results.append(sorted(s for s in tracker.open_sessions() if leaves(h, s)))
    assert results[0] == results[1]


def test_validator_catches_a_wrong_referenced_count():
    h = SHAPES["full"]()
    tracker = h.cache.session_ref_tracker
    tracker.configure_protection(1.0, 1)
    turn(h, prompt(0, 30), "a")
    tracker.components[FULL].ref_units += 1
    with pytest.raises(SessionStateError, match="ref_units"):
        h.cache.validate_session_state()
    tracker.components[FULL].ref_units -= 1


def test_capacity_matches_the_pools(h):
    tracker = h.cache.session_ref_tracker
    assert component_capacity(h.cache, FULL) == h.full_allocator.size
    if h.has_swa:
        assert component_capacity(h.cache, ComponentType.SWA) == h.swa_allocator.size
    if h.mamba_allocator is not None:
        assert component_capacity(h.cache, ComponentType.MAMBA) == h.mamba_allocator.size
    assert set(tracker.policy.limits) == set(tracker.components)


# ---- options --------------------------------------------------------------------------


def test_option_values():
    assert normalize_fraction(None) == DEFAULT_MAX_PROTECTED_FRACTION
    assert normalize_from_turn(None) == DEFAULT_PROTECT_FROM_TURN
    assert normalize_fraction("0.3") == 0.3
    assert normalize_from_turn("3") == 3
    for bad in (0, -0.1, 1.5, float("nan"), "x", True):
        with pytest.raises(ProtectionOptionError):
            normalize_fraction(bad)
    for bad in (0, -1, 1.5, "x", True):
        with pytest.raises(ProtectionOptionError):
            normalize_from_turn(bad)


def test_flags_reach_the_cache_through_server_args():
    """CLI -> ServerArgs (pickled to the scheduler) -> published -> cache."""
    import argparse
    import pickle

    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import ServerArgs
    from sglang_session_cache.protection_policy import published_options

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args([
        "--model-path", "dummy",
        "--session-radix-cache-max-protected-fraction", "0.3",
        "--session-radix-cache-protect-from-turn", "3",
    ])
    assert args.session_radix_cache_max_protected_fraction == 0.3
    assert args.session_radix_cache_protect_from_turn == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "dummy",
                           "--session-radix-cache-max-protected-fraction", "2"])
    h = SHAPES["full"]()
    sa = pickle.loads(pickle.dumps(get_context().server_args))
    assert (sa.session_radix_cache_max_protected_fraction,
            sa.session_radix_cache_protect_from_turn) == (1.0, 1)  # suite default
    object.__setattr__(get_context().server_args,
                       "session_radix_cache_max_protected_fraction", 0.3)
    object.__setattr__(get_context().server_args,
                       "session_radix_cache_protect_from_turn", 3)
    assert published_options() == (0.3, 3)
    h2 = SHAPES["full"]()  # re-publishes the suite's options
    assert h2.cache.session_ref_tracker.policy.protect_from_turn == 1
    assert h.cache.session_ref_tracker.policy.limits[FULL] == h.full_allocator.size
