"""``--session-radix-cache-protect-from-turn auto``: the learned return rate
(``session_return_rate.py``) and what the protection policy does with it on
the real UnifiedRadixCache: first requests are protected while sessions come
back, not once most of them do not, and the first-request-only protection
is withdrawn when the rate falls."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from session_test_utils import SHAPES, prompt, turn  # noqa: E402

from sglang.srt.mem_cache.unified_cache_components import ComponentType  # noqa: E402
from sglang_session_cache.component_refs import SessionStateError  # noqa: E402
from sglang_session_cache.protection_policy import AUTO, normalize_from_turn  # noqa: E402
from sglang_session_cache.session_return_rate import SessionReturnRate  # noqa: E402

FULL = ComponentType.FULL


# ---- the estimator alone -----------------------------------------------------------


def test_new_rate_protects_first_turns():
    rate = SessionReturnRate()
    assert rate.protect_first and rate.rate == 1.0


def test_sessions_that_never_return_turn_it_off_after_the_horizon():
    rate = SessionReturnRate(horizon=8)
    flips = [rate.started(f"s{i}") for i in range(8)]
    assert not any(flips) and rate.protect_first  # nothing resolved yet
    flips = [rate.started(f"s{i}") for i in range(8, 12)]
    assert any(flips) and not rate.protect_first
    assert rate.turned_off == 1
    assert len(rate.pending) <= 8
    assert rate.validate() is None


def test_returning_sessions_turn_it_back_on():
    rate = SessionReturnRate(horizon=4)
    for i in range(12):
        rate.started(f"one-{i}")
    assert not rate.protect_first
    for i in range(40):
        rate.started(f"conv-{i}")
        rate.returned(f"conv-{i}")
    assert rate.protect_first
    assert rate.rate > 0.5


def test_hysteresis_keeps_it_from_flapping():
    rate = SessionReturnRate(horizon=1, on_at=0.5, off_below=0.4, prior=0.0)
    rate.started("a")
    rate.returned("a")  # 1/1
    rate.started("b")
    rate.ended("b")  # 1/2 = 0.5: stays on
    assert rate.protect_first
    rate.started("c")
    rate.ended("c")  # ~0.33 < 0.4: off
    assert not rate.protect_first
    rate.started("d")
    rate.returned("d")  # ~0.5 again: back on only at >= 0.5
    assert rate.protect_first == (rate.rate >= 0.5)


def test_a_close_with_one_request_counts_as_not_returned():
    rate = SessionReturnRate(prior=0.0)
    rate.started("a")
    rate.ended("a")
    assert rate.rate == 0.0 and rate.resolved_weight == 1.0
    rate.ended("a")  # idempotent: already resolved
    assert rate.resolved_weight == 1.0


def test_a_late_return_corrects_an_age_out():
    rate = SessionReturnRate(horizon=2, prior=0.0)
    for sid in ("a", "b", "c"):
        rate.started(sid)
    assert "a" in rate.aged_out and rate.returned_weight == 0.0
    rate.returned("a")
    assert rate.returned_weight == 1.0 and rate.resolved_weight == 1.0
    assert rate.validate() is None


def test_pending_and_aged_out_stay_bounded():
    rate = SessionReturnRate(horizon=16)
    for i in range(10_000):
        rate.started(f"s{i}")
    assert len(rate.pending) <= 16 and len(rate.aged_out) <= 16


def test_option_accepts_auto():
    assert normalize_from_turn("auto") == AUTO
    assert normalize_from_turn(" AUTO ") == AUTO
    assert normalize_from_turn(None) == AUTO  # the default


# ---- on the real cache --------------------------------------------------------------


def leaves(h, sid):
    return h.cache.session_ref_tracker.session_leaves(sid, FULL)


@pytest.fixture(params=list(SHAPES))
def h(request):
    harness = SHAPES[request.param](num_tokens=4096)
    harness.cache.session_ref_tracker.configure_protection(1.0, AUTO)
    yield harness
    harness.cache.validate_session_state()
    harness.check()


def test_returning_traffic_protects_first_requests(h):
    tracker = h.cache.session_ref_tracker
    for i in range(6):
        base = prompt(1000 * i, 30)
        turn(h, base, f"conv-{i}")
        assert leaves(h, f"conv-{i}"), "first request protected"
        turn(h, base + prompt(1000 * i + 500, 5), f"conv-{i}")
    assert tracker.policy.protects_first_turn
    assert h.cache.session_metrics()["protect_first_turn"] == 1


def test_single_shot_traffic_turns_first_request_protection_off(h):
    """Tagging every call: once the tagged one-shots age out unanswered,
    first requests stop being protected, the ones protected so far lose it,
    and a conversation is protected once it returns."""
    tracker = h.cache.session_ref_tracker
    horizon = tracker.policy.return_rate.horizon
    for i in range(horizon + 8):
        turn(h, prompt(100_000 + 40 * i, 8), f"oneshot-{i}")
    assert not tracker.policy.protects_first_turn
    assert all(not leaves(h, f"oneshot-{i}") for i in range(horizon + 8))
    assert tracker.policy.first_turn_withdrawals > 0
    assert not tracker.policy.first_turn_only
    snap = h.cache.session_metrics()
    assert snap["protect_first_turn"] == 0 and snap["session_return_rate"] < 0.4
    assert snap["first_turn_withdrawals"] == tracker.policy.first_turn_withdrawals
    conv = prompt(0, 30)
    turn(h, conv, "agent")
    assert not leaves(h, "agent")  # must earn it now
    turn(h, conv + prompt(700, 5), "agent")
    assert leaves(h, "agent")
    h.cache.validate_session_state()


def test_bound_withdraws_first_request_only_sessions_first():
    h = SHAPES["full"](num_tokens=256)
    tracker = h.cache.session_ref_tracker
    tracker.configure_protection(0.5, AUTO)  # at most 128 referenced tokens
    old = prompt(0, 40)
    turn(h, old, "returned")
    turn(h, old + prompt(100, 10), "returned")  # 50 tokens, earned for good
    turn(h, prompt(300, 40), "new-1")  # first request only
    turn(h, prompt(500, 45), "new-2")  # 135 > 128: new-1 goes, not "returned"
    assert leaves(h, "returned") and leaves(h, "new-2") and not leaves(h, "new-1")
    assert tracker.components[FULL].ref_units <= 128
    h.cache.validate_session_state()


def test_validator_catches_first_request_marks_on_returned_sessions():
    h = SHAPES["full"]()
    tracker = h.cache.session_ref_tracker
    tracker.configure_protection(1.0, AUTO)
    turn(h, prompt(0, 30), "a")
    assert "a" in tracker.policy.first_turn_only
    tracker.policy.turns["a"] = 2
    with pytest.raises(SessionStateError, match="first-request-only"):
        h.cache.validate_session_state()
    tracker.policy.turns["a"] = 1


def test_decisions_follow_events_not_clocks():
    """Two ranks with different clocks learn the same rate and protect the
    same sessions."""
    outcomes = []
    for offset in (0.0, 98765.0):
        h = SHAPES["full"](num_tokens=2048)
        tracker = h.cache.session_ref_tracker
        tracker.clock = lambda offset=offset: offset
        tracker.configure_protection(0.6, AUTO)
        for i in range(150):
            sid = f"c{i % 9}" if i % 3 else f"one-{i}"
            turn(h, prompt(300 * (i % 9), 20) + prompt(50_000 + i, 3), sid)
        outcomes.append((tracker.policy.return_rate.rate,
                         tracker.policy.first_turn_withdrawals,
                         sorted(s for s in tracker.open_sessions() if leaves(h, s))))
    assert outcomes[0] == outcomes[1]


def test_auto_flag_parses_and_is_the_default():
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "dummy",
                              "--session-radix-cache-protect-from-turn", "auto"])
    assert args.session_radix_cache_protect_from_turn == AUTO
    assert parser.parse_args(["--model-path", "dummy"]).session_radix_cache_protect_from_turn is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "dummy",
                           "--session-radix-cache-protect-from-turn", "sometimes"])


def test_unstamped_finishes_withdraw_when_the_rate_falls(h):
    """Requests that reach the finish without an arrival stamp (direct cache
    callers) are counted there; the one that turns first-request protection
    off is refused, and the protections kept so far go at once, as they do
    when an arrival turns it off."""
    tracker = h.cache.session_ref_tracker
    horizon = tracker.policy.return_rate.horizon
    for i in range(horizon + 8):
        req = h.new_req(prompt(100_000 + 40 * i, 8), session_id=f"oneshot-{i}")
        h.prefill(req, finishing=True)
        h.finish(req)  # counted (and maybe refused) here, never stamped
        h.cache.validate_session_state()
    assert not tracker.policy.protects_first_turn
    assert not tracker.policy.withdraw_pending and not tracker.policy.first_turn_only
    assert all(not leaves(h, f"oneshot-{i}") for i in range(horizon + 8))
