"""Session TTL (``--session-radix-cache-ttl``) on the real UnifiedRadixCache:
idle sessions are released as if closed, activity keeps them open, expiry is
amortized, and the option travels from the CLI to the cache.  Time comes from
an injected clock."""

import logging
import os
import pickle
import sys
from collections import OrderedDict
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from session_test_utils import SHAPES, arrive, make_scheduler, prompt  # noqa: E402
from cache_fixtures import make_full_cache  # noqa: E402

from sglang.srt.managers.io_struct import (  # noqa: E402
    CloseSessionReqInput,
    OpenSessionReqInput,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.unified_cache_components import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.srt.runtime_context import get_context  # noqa: E402
from sglang.srt.server_args import ServerArgs, prepare_server_args  # noqa: E402
from sglang_session_cache.session_ttl import (  # noqa: E402
    EXPIRY_LOG_INTERVAL_S,
    SessionTTLError,
    normalize_ttl,
)

FULL = ComponentType.FULL
TTL = 10.0
CACHE_LOGGER = "sglang.srt.mem_cache.unified_radix_cache"



class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def with_ttl(h, ttl=TTL):
    clock = Clock()
    tracker = h.cache.session_ref_tracker
    tracker.clock = clock
    tracker.set_ttl(ttl)
    return tracker, clock


@pytest.fixture(params=list(SHAPES))
def h(request):
    harness = SHAPES[request.param]()
    yield harness
    harness.cache.validate_session_state()
    harness.check()


def run(h, req, n_decode=0):
    h.prefill(req, finishing=n_decode == 0)
    if n_decode:
        h.decode(req, n_decode)
    h.finish(req)
    return req


# ---- off by default ------------------------------------------------------------


def test_ttl_is_off_by_default(h):
    tracker = h.cache.session_ref_tracker
    assert tracker.ttl is None
    clock = Clock()
    tracker.clock = clock
    h.run_request(prompt(0), session_id="s")
    clock.advance(10**9)
    assert h.cache.expire_idle_sessions() == 0
    tracker.tick()
    h.run_request(prompt(300))  # a finish ticks the TTL too
    assert tracker.open_sessions() == ["s"]
    assert tracker.session_leaves("s")
    assert tracker.counters.expired == 0
    assert h.cache.session_metrics()["open_sessions"] == 1


def test_flag_off_cache_has_no_ttl():
    h = make_full_cache(enable_session=False)
    assert h.cache.session_ref_tracker is None
    assert h.cache.expire_idle_sessions() == 0
    h.run_request(prompt(0), session_id="s")
    h.evict(num_tokens=8)
    h.check()


def test_normalize_ttl():
    assert normalize_ttl(None) is None
    assert normalize_ttl(0) is None
    assert normalize_ttl("0") is None
    assert normalize_ttl("30") == 30.0
    assert normalize_ttl(0.5) == 0.5
    for bad in (-1, "-0.1", float("nan"), float("inf"), "abc", True, [1]):
        with pytest.raises(SessionTTLError):
            normalize_ttl(bad)


# ---- expiry behaves like close -------------------------------------------------


def test_idle_session_expires_like_close(h):
    tracker, clock = with_ttl(h)
    a = prompt(0)
    h.run_request(a, session_id="a", n_decode=3)
    h.run_request(prompt(500), session_id="b", n_decode=3)
    assert tracker.session_leaves("a") and tracker.session_leaves("b")
    evictable = h.cache.full_evictable_size()

    clock.advance(TTL - 1)
    assert h.cache.expire_idle_sessions() == 0
    clock.advance(1)  # idle for exactly the TTL
    assert h.cache.expire_idle_sessions() == 2
    for sid in ("a", "b"):
        assert sid not in tracker.open_sessions()
        assert sid in tracker.closed  # tombstoned
        for ct in h.cache.tree_components:
            if ct in tracker.components:
                assert not tracker.session_leaves(sid, ct)
    assert all(
        n.component_data[ct].session_ref == 0
        for n in h.tree_nodes()
        for ct in tracker.components
    )
    assert tracker.counters.expired == 2
    assert tracker.counters.closed == 0
    # The KV stays cached and reusable.
    assert h.cache.full_evictable_size() == evictable
    assert h.match_len(a) > 0
    # A later close of the expired id is a quiet no-op.
    assert h.cache.release_radix_session("a") == 0
    assert tracker.counters.closed == 0


def test_late_finish_after_expiry_registers_nothing(h):
    tracker, clock = with_ttl(h)
    req = arrive(h, prompt(0), "s")
    h.prefill(req)
    h.decode(req, 2)
    clock.advance(TTL + 1)  # the request outlived the session's TTL
    h.finish(req)
    assert tracker.counters.expired == 1
    assert tracker.counters.late_finish_skipped == 1
    assert tracker.counters.registered == 0
    assert "s" not in tracker.open_sessions()
    assert not tracker.session_leaves("s")


def test_new_request_reopens_with_a_new_generation(h):
    tracker, clock = with_ttl(h)
    first = arrive(h, prompt(0), "s")
    run(h, first)
    old_gen = first.session_ref_generation
    inflight = arrive(h, prompt(0, 50), "s")  # same generation, still running
    h.prefill(inflight)

    clock.advance(TTL + 1)
    second = arrive(h, prompt(0, 60), "s")  # expires "s", then reopens it
    assert second.session_ref_generation > old_gen
    assert tracker.counters.expired == 1
    assert tracker.counters.opened == 2
    assert "s" in tracker.open_sessions() and "s" not in tracker.closed

    h.finish(inflight)  # old generation: rejected, not registered
    assert tracker.counters.stale_rejected == 1
    run(h, second)
    assert tracker.counters.registered == 2
    assert tracker.session_leaves("s")


# ---- activity -------------------------------------------------------------------------


def test_arrivals_and_finishes_are_activity(h):
    tracker, clock = with_ttl(h)
    run(h, arrive(h, prompt(0), "busy"))
    run(h, arrive(h, prompt(300), "idle"))

    # "busy" gets a request every 0.6 TTL: an arrival, then its finish.
    for i in range(3):
        clock.advance(0.6 * TTL)
        req = arrive(h, prompt(0, 44 + 4 * i), "busy")
        clock.advance(0.6 * TTL)
        run(h, req)
    assert tracker.open_sessions() == ["busy"]
    assert tracker.counters.expired == 1  # "idle"
    assert tracker.counters.late_finish_skipped == 0
    assert tracker.counters.registered == 5


def test_arrival_keeps_a_long_running_turn_alive(h):
    tracker, clock = with_ttl(h)
    long_turn = arrive(h, prompt(0), "s")
    h.prefill(long_turn)
    clock.advance(0.8 * TTL)
    run(h, arrive(h, prompt(700), "s"))  # another request of the session
    clock.advance(0.8 * TTL)  # 1.6 TTL after the long turn arrived
    h.decode(long_turn, 2)
    h.finish(long_turn)
    assert tracker.counters.expired == 0
    assert tracker.counters.registered == 2


def test_explicit_open_is_activity(h):
    tracker, clock = with_ttl(h)
    h.cache.open_radix_session("s")
    clock.advance(0.9 * TTL)
    h.cache.open_radix_session("s")  # already open: refreshes, same generation
    clock.advance(0.9 * TTL)
    assert h.cache.expire_idle_sessions() == 0
    clock.advance(0.2 * TTL)
    assert h.cache.expire_idle_sessions() == 1


def test_streaming_sessions_are_not_expired(h):
    tracker, clock = with_ttl(h)
    h.cache.open_radix_session("stream", streaming=True)
    clock.advance(10 * TTL)
    tracker.tick()
    assert "stream" in tracker.streaming
    assert tracker.counters.expired == 0


# ---- expiry before eviction ------------------------------------------------------------


@pytest.mark.parametrize("expired", [False, True])
def test_expired_session_is_unreferenced_before_eviction(expired):
    h = make_full_cache(enable_session=True, num_tokens=128)
    tracker, clock = with_ttl(h)
    agent = prompt(0)
    plain = prompt(400)
    h.run_request(agent, session_id="agent")  # older, referenced
    clock.advance(1)
    h.run_request(plain)  # newer, never referenced
    clock.advance(TTL if expired else TTL - 2)
    h.evict(num_tokens=40)  # the eviction itself runs the TTL check first
    if expired:
        # Released first, then evicted as the LRU-older unreferenced entry.
        assert tracker.counters.expired == 1
        assert h.match_len(agent) == 0 and h.match_len(plain) == 40
    else:
        assert tracker.counters.expired == 0
        assert h.match_len(agent) == 40 and h.match_len(plain) == 0
    assert tracker.referenced_evictions[FULL] == 0  # never a breach
    h.cache.validate_session_state()
    h.check()


def test_finish_of_any_request_ticks_the_ttl():
    h = make_full_cache(enable_session=True)
    tracker, clock = with_ttl(h)
    h.run_request(prompt(0), session_id="s")
    clock.advance(TTL + 1)
    h.run_request(prompt(300))  # no session: still a cheap expiry check
    assert tracker.counters.expired == 1
    h.cache.validate_session_state()


# ---- amortized expiry --------------------------------------------------------------------


class CountingOrderedDict(OrderedDict):
    lookups = 0

    def __getitem__(self, key):
        CountingOrderedDict.lookups += 1
        return super().__getitem__(key)


def test_expiry_is_amortized():
    h = make_full_cache(enable_session=True)
    tracker, clock = with_ttl(h, ttl=2000)
    tracker.last_active = CountingOrderedDict()
    n = 1000
    for i in range(n):  # session i is last active at t0 + i
        tracker.open_radix_session(f"s{i}")
        clock.advance(1)
    CountingOrderedDict.lookups = 0
    for _ in range(100):  # 100 ticks, nothing due: one look at the front each
        tracker.tick()
    assert CountingOrderedDict.lookups == 100

    clock.advance(1800)  # now t0 + 2800: sessions 0..800 are due
    CountingOrderedDict.lookups = 0
    expired = tracker.expire_idle_sessions()
    assert expired == 801
    assert CountingOrderedDict.lookups == expired + 1
    assert list(tracker.last_active) == [f"s{i}" for i in range(expired, n)]
    tracker.validate_session_state()

    # Activity moves a session to the back of the line.
    first = next(iter(tracker.last_active))
    tracker.open_radix_session(first)
    assert next(reversed(tracker.last_active)) == first


# ---- logging ----------------------------------------------------------------------


def test_expiries_are_logged_aggregated(caplog):
    h = make_full_cache(enable_session=True)
    tracker, clock = with_ttl(h)

    def expiry_lines():
        return [
            r.getMessage()
            for r in caplog.records
            if r.name == CACHE_LOGGER and "idle session" in r.getMessage()
        ]

    with caplog.at_level(logging.INFO, logger=CACHE_LOGGER):
        for i in range(3):
            tracker.open_radix_session(f"a{i}")
        clock.advance(TTL)
        tracker.tick()
        assert expiry_lines() == [
            "Session radix cache: expired 3 idle sessions (no activity for 10s); "
            "their references were released, the KV stays cached."
        ]
        assert all(r.levelno == logging.INFO for r in caplog.records if r.name == CACHE_LOGGER)

        for i in range(2):  # within the log interval: counted, not logged yet
            tracker.open_radix_session(f"b{i}")
        clock.advance(TTL)
        tracker.tick()
        assert len(expiry_lines()) == 1

        clock.advance(EXPIRY_LOG_INTERVAL_S)
        tracker.tick()  # nothing new expires; the pending count is flushed
        lines = expiry_lines()
        assert len(lines) == 2 and "expired 2 idle sessions" in lines[1]


# ---- the option: CLI -> ServerArgs -> scheduler process -> cache ---------------------------


@pytest.fixture
def isolate_server_args():
    """prepare_server_args() reconfigures root logging (basicConfig(force=True));
    put logging and the published ServerArgs back afterwards."""
    ctx = get_context()
    saved = ctx._server_args
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    if saved is None:
        ctx._server_args = None
    else:
        ctx.set_server_args(saved)


def test_cli_option_reaches_the_cache(isolate_server_args):
    h = make_full_cache(enable_session=True)  # pools for the cache built below
    args = prepare_server_args(
        ["--model-path", "dummy", "--enable-session-radix-cache",
         "--session-radix-cache-ttl", "30"]
    )
    assert args.session_radix_cache_ttl == 30.0
    # What the scheduler process receives (spawn pickles ServerArgs) and
    # publishes (ModelRunner -> set_global_server_args_for_scheduler).
    args = pickle.loads(pickle.dumps(args))
    assert args.session_radix_cache_ttl == 30.0
    get_context().set_server_args(args)
    cache = UnifiedRadixCache(
        CacheInitParams(
            disable=False,
            req_to_token_pool=h.req_to_token_pool,
            token_to_kv_pool_allocator=h.allocator,
            page_size=1,
            eviction_policy=args.radix_eviction_policy,
            enable_session_radix_cache=args.enable_session_radix_cache,
            tree_components=(FULL,),
        )
    )
    assert cache.session_ref_tracker.ttl == 30.0
    assert cache.session_metrics()["ttl_s"] == 30.0


def test_cli_option_defaults_and_validation(isolate_server_args):
    assert prepare_server_args(["--model-path", "dummy"]).session_radix_cache_ttl is None
    zero = prepare_server_args(["--model-path", "dummy", "--session-radix-cache-ttl", "0"])
    assert zero.session_radix_cache_ttl is None
    with pytest.raises(SystemExit):
        prepare_server_args(["--model-path", "dummy", "--session-radix-cache-ttl", "-5"])
    assert ServerArgs.session_radix_cache_ttl is None  # class default: off
    assert "session_radix_cache_ttl" not in {
        f.name for f in __import__("dataclasses").fields(ServerArgs)
    }


def test_engine_keyword():
    args = ServerArgs(model_path="dummy", session_radix_cache_ttl=15)
    assert args.session_radix_cache_ttl == 15.0
    assert ServerArgs(model_path="dummy").session_radix_cache_ttl is None
    with pytest.raises(SessionTTLError):
        ServerArgs(model_path="dummy", session_radix_cache_ttl=-1)


def test_ttl_without_session_flag_warns(caplog):
    from sglang_session_cache.patches.server_wiring import _wrap_create_tree_cache

    plain = make_full_cache(enable_session=False).cache
    args = SimpleNamespace(enable_session_radix_cache=False, session_radix_cache_ttl=30.0)
    with caplog.at_level(logging.WARNING):
        _wrap_create_tree_cache(lambda _ctx: plain)(SimpleNamespace(server_args=args))
    assert "--session-radix-cache-ttl has no effect" in caplog.text

    caplog.clear()
    on = make_full_cache(enable_session=True).cache
    args = SimpleNamespace(enable_session_radix_cache=True, session_radix_cache_ttl=30.0)
    with caplog.at_level(logging.WARNING):
        _wrap_create_tree_cache(lambda _ctx: on)(SimpleNamespace(server_args=args))
    assert "no effect" not in caplog.text


# ---- through the scheduler -----------------------------------------------------------------


def test_scheduler_arrivals_refresh_and_reopen():
    h = make_full_cache(enable_session=True)
    tracker, clock = with_ttl(h)
    sched = make_scheduler(h.cache)
    sched.open_session(OpenSessionReqInput(capacity_of_str_len=64, session_id="agent"))
    gen = tracker.generations["agent"]

    clock.advance(0.9 * TTL)
    req = h.new_req(prompt(0), session_id="agent")
    sched._add_request_to_queue(req)
    assert req.session_ref_generation == gen
    sched.waiting_queue.clear()
    run(h, req)

    clock.advance(TTL)
    late = h.new_req(prompt(0, 50), session_id="agent")
    sched._add_request_to_queue(late)
    assert late.session_ref_generation > gen  # expired, implicitly reopened
    assert tracker.counters.expired == 1

    sched.close_session(CloseSessionReqInput(session_id="agent"))
    assert tracker.counters.closed == 1
    h.cache.validate_session_state()
