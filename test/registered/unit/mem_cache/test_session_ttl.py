"""Session TTL (``--session-radix-cache-ttl``) on the real UnifiedRadixCache:
a session with no request in flight and no arrival or finish for the TTL is
released as if closed; time is the shared clock the scheduler delivers
(``advance_session_clock``), never a clock read on the rank."""

import heapq
import logging
import os
import pickle
import sys
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from session_test_utils import (  # noqa: E402,F401 (checked_harness: fixture h)
    SHAPES,
    arrive,
    checked_harness,
    make_scheduler,
    prompt,
)
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
from sglang_session_cache import session_idle  # noqa: E402
from sglang_session_cache.session_idle import BUSY_LEAK_TIMEOUT_S  # noqa: E402
from sglang_session_cache.session_ttl import (  # noqa: E402
    EXPIRY_LOG_INTERVAL_S,
    SessionTTLError,
    normalize_ttl,
)

FULL = ComponentType.FULL
TTL = 10.0
CACHE_LOGGER = "sglang.srt.mem_cache.unified_radix_cache"


class Clock:
    """The shared clock as the scheduler delivers it (a tick per poll)."""

    def __init__(self, cache, t: float = 1000.0):
        self.cache = cache
        self.t = t
        cache.advance_session_clock(t)

    def advance(self, dt: float) -> int:
        """Move on and deliver; returns how many sessions expired."""
        self.t += dt
        return self.cache.advance_session_clock(self.t)


def with_ttl(h, ttl=TTL):
    clock = Clock(h.cache)
    tracker = h.cache.session_ref_tracker
    tracker.set_ttl(ttl)
    return tracker, clock


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
    clock = Clock(h.cache)
    h.run_request(prompt(0), session_id="s")
    assert clock.advance(10**9) == 0
    assert h.cache.expire_idle_sessions() == 0
    h.run_request(prompt(300))
    assert tracker.open_sessions() == ["s"]
    assert tracker.session_leaves("s")
    assert tracker.counters.expired == 0
    assert h.cache.session_metrics()["open_sessions"] == 1


def test_flag_off_cache_has_no_ttl():
    h = make_full_cache(enable_session=False)
    assert h.cache.session_ref_tracker is None
    assert h.cache.expire_idle_sessions() == 0
    assert h.cache.advance_session_clock(10.0) == 0
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

    assert clock.advance(TTL - 1) == 0
    assert clock.advance(1) == 2  # idle for exactly the TTL
    assert h.cache.expire_idle_sessions() == 0  # nothing left due
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


# ---- busy means in flight (issue 11 item 2) ------------------------------------------


def test_long_in_flight_request_is_never_expired(h):
    tracker, clock = with_ttl(h)
    req = arrive(h, prompt(0), "s")
    h.prefill(req)
    for _ in range(10):  # 10 TTLs of decode with no other activity
        assert clock.advance(TTL) == 0
        h.decode(req, 1)
    h.finish(req)
    assert tracker.counters.expired == 0
    assert tracker.counters.late_finish_skipped == 0
    assert tracker.counters.registered == 1
    assert tracker.session_leaves("s")


def test_idle_clock_starts_at_the_last_finish(h):
    tracker, clock = with_ttl(h)
    a = arrive(h, prompt(0), "s")
    b = arrive(h, prompt(0, 50), "s")  # two requests of one session in flight
    h.prefill(a)
    h.prefill(b)
    clock.advance(3 * TTL)
    h.decode(a, 1)
    h.finish(a)  # one still in flight: not idle
    assert clock.advance(3 * TTL) == 0
    h.decode(b, 1)
    h.finish(b)  # the last one ends: idle from here
    assert tracker.idle.inflight("s") == 0
    assert clock.advance(TTL - 0.5) == 0
    assert clock.advance(0.5) == 1
    assert tracker.counters.registered == 2


def test_queued_request_keeps_the_session_busy(h):
    tracker, clock = with_ttl(h)
    run(h, arrive(h, prompt(0), "s"))
    queued = arrive(h, prompt(0, 50), "s")  # waits in the queue for 2 TTLs
    assert clock.advance(2 * TTL) == 0
    run(h, queued)
    assert tracker.counters.registered == 2 and tracker.counters.expired == 0


def test_aborted_or_unregistered_finish_ends_the_busy_time(h):
    tracker, clock = with_ttl(h)
    req = arrive(h, prompt(0), "s")
    h.prefill(req)
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    req.finished_reason = FINISH_ABORT("client went away")
    h.finish(req)  # release_kv_cache -> cache_finished_req: nothing registered
    assert tracker.idle.inflight("s") == 0
    assert clock.advance(TTL) == 1


def test_lost_finish_is_bounded_by_the_leak_timeout():
    h = make_full_cache(enable_session=True)
    tracker, clock = with_ttl(h)
    arrive(h, prompt(0), "s")  # never finishes (left the scheduler unseen)
    assert clock.advance(BUSY_LEAK_TIMEOUT_S - 1) == 0
    assert clock.advance(1) == 1


def test_retracted_request_is_counted_once(h):
    tracker, clock = with_ttl(h)
    req = arrive(h, prompt(0), "s")
    h.cache.ensure_session_generation(req)  # requeued (retraction): no double count
    assert tracker.idle.inflight("s") == 1
    run(h, req)
    assert tracker.idle.inflight("s") == 0
    assert clock.advance(TTL) == 1


def test_expired_session_reopens_cleanly(h):
    tracker, clock = with_ttl(h)
    first = run(h, arrive(h, prompt(0), "s"))
    old_gen = first.session_ref_generation
    assert clock.advance(TTL) == 1
    second = arrive(h, prompt(0, 60), "s")  # reopens with a new generation
    assert second.session_ref_generation > old_gen
    assert tracker.counters.opened == 2
    assert "s" in tracker.open_sessions() and "s" not in tracker.closed
    assert tracker.idle.inflight("s") == 1
    assert clock.advance(5 * TTL) == 0  # busy again
    run(h, second)
    assert tracker.counters.registered == 2
    assert tracker.session_leaves("s")


def test_late_finish_after_close_registers_nothing(h):
    tracker, clock = with_ttl(h)
    req = arrive(h, prompt(0), "s")
    h.prefill(req)
    h.cache.release_radix_session("s")
    h.finish(req)
    assert tracker.counters.late_finish_skipped == 1
    assert tracker.counters.registered == 0
    assert clock.advance(10 * TTL) == 0


def test_arrivals_and_finishes_are_activity(h):
    tracker, clock = with_ttl(h)
    run(h, arrive(h, prompt(0), "busy"))
    run(h, arrive(h, prompt(300), "idle"))

    # "busy" gets a request every 0.6 TTL of idle time.
    for i in range(3):
        clock.advance(0.6 * TTL)
        req = arrive(h, prompt(0, 44 + 4 * i), "busy")
        clock.advance(0.6 * TTL)
        run(h, req)
    assert tracker.open_sessions() == ["busy"]
    assert tracker.counters.expired == 1  # "idle"
    assert tracker.counters.late_finish_skipped == 0
    assert tracker.counters.registered == 5


def test_explicit_open_is_activity(h):
    tracker, clock = with_ttl(h)
    h.cache.open_radix_session("s")
    clock.advance(0.9 * TTL)
    h.cache.open_radix_session("s")  # already open: refreshes, same generation
    assert clock.advance(0.9 * TTL) == 0
    assert clock.advance(0.2 * TTL) == 1


def test_open_session_timeout_is_the_session_ttl(h):
    """/open_session's ``timeout``: SGLang's reaper closes the controller
    session on each rank's own clock; the references follow the same timeout
    on the shared clock, so every rank releases them at the same step."""
    tracker, clock = with_ttl(h, ttl=None)  # no global TTL
    h.cache.open_radix_session("t", timeout=3.0)
    h.cache.open_radix_session("forever")
    run(h, arrive(h, prompt(0), "t"))
    run(h, arrive(h, prompt(300), "forever"))
    assert clock.advance(2.9) == 0
    assert clock.advance(0.1) == 1
    assert tracker.open_sessions() == ["forever"]
    assert clock.advance(10**6) == 0


def test_streaming_sessions_are_not_expired(h):
    tracker, clock = with_ttl(h)
    h.cache.open_radix_session("stream", streaming=True)
    assert clock.advance(10 * TTL) == 0
    assert "stream" in tracker.streaming
    assert tracker.counters.expired == 0


def test_clock_never_moves_backwards(h):
    tracker, clock = with_ttl(h)
    run(h, arrive(h, prompt(0), "s"))
    assert h.cache.advance_session_clock(clock.t - 100) == 0
    assert tracker.now == clock.t
    assert clock.advance(TTL) == 1


# ---- nothing but the shared clock expires ----------------------------------------------


def test_reads_evictions_and_finishes_never_expire():
    h = make_full_cache(enable_session=True, num_tokens=128)
    tracker, clock = with_ttl(h)
    h.run_request(prompt(0), session_id="agent")
    # However long the wall time, without a delivered tick nothing expires.
    h.cache.session_metrics()
    h.run_request(prompt(400))
    h.evict(num_tokens=40)
    assert tracker.counters.expired == 0
    assert tracker.open_sessions() == ["agent"]
    assert h.match_len(prompt(0)) == 40  # the unreferenced request went first


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
    h.evict(num_tokens=40)
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


# ---- amortized expiry, bounded heap ---------------------------------------------------------


def test_expiry_is_amortized(monkeypatch):
    h = make_full_cache(enable_session=True)
    tracker, clock = with_ttl(h, ttl=2000)
    pops = []
    real_pop = heapq.heappop
    monkeypatch.setattr(session_idle.heapq, "heappop", lambda hp: pops.append(1) or real_pop(hp))
    n = 1000
    for i in range(n):  # session i is opened at t0 + i
        tracker.open_radix_session(f"s{i}")
        clock.advance(1)
    for _ in range(100):  # 100 ticks, nothing due: no heap work
        clock.advance(0)
    assert not pops

    expired = clock.advance(1800)  # now t0 + 2800: sessions 0..800 are due
    assert expired == 801
    assert len(pops) == expired
    assert tracker.open_sessions() == [f"s{i}" for i in range(expired, n)]
    tracker.validate_session_state()

    # Heavy activity on few sessions keeps the heap within 2x + 64 entries.
    for _ in range(5000):
        tracker.open_radix_session("s999")
    assert tracker.idle.heap_size() <= 2 * len(tracker.generations) + 64
    tracker.validate_session_state()


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
        assert expiry_lines() == [
            "Session radix cache: expired 3 idle sessions (no activity for 10s); "
            "their references were released, the KV stays cached."
        ]
        assert all(r.levelno == logging.INFO for r in caplog.records if r.name == CACHE_LOGGER)

        for i in range(2):  # within the log interval: counted, not logged yet
            tracker.open_radix_session(f"b{i}")
        clock.advance(TTL)
        assert len(expiry_lines()) == 1

        clock.advance(EXPIRY_LOG_INTERVAL_S)  # nothing new; the pending count is flushed
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

    assert clock.advance(TTL) == 1
    late = h.new_req(prompt(0, 50), session_id="agent")
    sched._add_request_to_queue(late)
    assert late.session_ref_generation > gen  # expired, implicitly reopened

    sched.close_session(CloseSessionReqInput(session_id="agent"))
    assert tracker.counters.closed == 1
    h.cache.validate_session_state()


def test_scheduler_open_session_timeout_reaches_the_tracker():
    h = make_full_cache(enable_session=True)
    tracker, clock = with_ttl(h, ttl=None)
    sched = make_scheduler(h.cache)
    sched.open_session(
        OpenSessionReqInput(capacity_of_str_len=64, session_id="t", timeout=5.0)
    )
    run(h, arrive(h, prompt(0), "t"))
    assert clock.advance(5.0) == 1
    # SGLang's reaper (its own clock) closes the controller session; the
    # references are already gone and a second release is a no-op.
    sched.session_controller.sessions["t"].last_active_time = -1e9
    sched.session_controller.maybe_reap(now=1e9)
    assert "t" not in sched.session_controller
    assert tracker.counters.expired == 1 and tracker.counters.closed == 0
    h.cache.validate_session_state()


# ---- memory bounds (issue 12) -------------------------------------------------------------


def test_abandoned_sessions_without_ttl_are_bounded():
    h = make_full_cache(enable_session=True)
    tracker = h.cache.session_ref_tracker
    tracker.max_open_sessions = 8
    busy = arrive(h, prompt(0), "busy")  # in flight: never the one released
    for i in range(20):
        h.run_request(prompt(100 + 50 * (i % 3), 8), session_id=f"a{i}")
    assert len(tracker.generations) == 8
    assert "busy" in tracker.generations
    # The least recently active idle sessions went first, as if closed.
    assert tracker.open_sessions() == ["busy"] + [f"a{i}" for i in range(13, 20)]
    assert tracker.counters.evicted_open == 13
    assert "a0" in tracker.closed
    run(h, busy)
    h.cache.validate_session_state()
    h.check()


def test_tombstones_are_bounded_in_characters():
    h = make_full_cache(enable_session=True)
    tracker = h.cache.session_ref_tracker
    tracker.tombstone_chars = 2_500
    for i in range(50):
        tracker.release_radix_session(f"{i:04d}" + "x" * 246)  # 250-char ids
    assert len(tracker.closed) == 10
    assert tracker._tombstone_chars_used == 2_500
    assert next(iter(tracker.closed)).startswith("0040")
    tracker.open_radix_session("0049" + "x" * 246)  # reopening forgets the tombstone
    assert tracker._tombstone_chars_used == 2_250


def test_streaming_ids_are_bounded():
    h = make_full_cache(enable_session=True)
    tracker = h.cache.session_ref_tracker
    tracker.streaming_limit = 5
    for i in range(12):
        tracker.open_radix_session(f"st{i}", streaming=True)
    assert list(tracker.streaming) == [f"st{i}" for i in range(7, 12)]
    tracker.release_radix_session("st11")  # close forgets it
    assert "st11" not in tracker.streaming


def test_open_sessions_are_bounded_in_characters():
    h = make_full_cache(enable_session=True)
    tracker = h.cache.session_ref_tracker
    tracker.max_open_chars = 1_250
    for i in range(12):
        tracker.open_radix_session(f"{i:03d}" + "y" * 247)
    assert len(tracker.generations) == 5
    assert tracker._open_chars_used == 1_250
    assert tracker.counters.evicted_open == 7
    tracker.validate_session_state()


# ---- requests that leave the queue without a finish ---------------------------------------


def _queue_scheduler(h):
    from sglang.srt.managers.schedule_batch import FINISH_ABORT  # noqa: F401

    sched = make_scheduler(h.cache)
    sent = []
    sched.ipc_channels = SimpleNamespace(
        send_to_tokenizer=SimpleNamespace(send_output=lambda out, req: sent.append(out))
    )
    sched.chunked_req = None
    sched.dllm_config = None
    sched.grammar_manager = SimpleNamespace(abort_requests=lambda r: None)
    sched.ps = SimpleNamespace(pp_rank=0, tp_rank=0, attn_cp_rank=0, pp_size=1)
    sched.running_batch = None
    sched.last_batch = None
    sched.enable_hierarchical_cache = False
    sched._prefetch_kvcache = lambda req: None
    return sched, sent


def test_request_aborted_while_queued_stops_keeping_its_session_busy():
    from sglang.srt.managers.io_struct import AbortReq

    h = make_full_cache(enable_session=True)
    tracker, clock = with_ttl(h)
    sched, sent = _queue_scheduler(h)
    req = h.new_req(prompt(0), session_id="s", rid="gone-1")
    other = h.new_req(prompt(300), session_id="t", rid="kept-1")
    sched._add_request_to_queue(req)
    sched._add_request_to_queue(other)
    assert tracker.idle.inflight("s") == 1
    sched.abort_request(AbortReq(rid="gone-1"))  # popped from the queue, never ran
    assert [r.rid for r in sched.waiting_queue] == ["kept-1"]
    assert tracker.idle.inflight("s") == 0 and tracker.idle.inflight("t") == 1
    assert clock.advance(TTL) == 1  # "s" idle from the abort; "t" still queued
    assert tracker.open_sessions() == ["t"]


def test_request_refused_or_preempted_by_the_queue_limit():
    h = make_full_cache(enable_session=True)
    tracker, clock = with_ttl(h)
    sched, sent = _queue_scheduler(h)
    sched.max_queued_requests = 1
    sched.enable_priority_scheduling = True
    sched.schedule_low_priority_values_first = True
    sched.enable_hicache_storage = False
    low = h.new_req(prompt(0), session_id="low", priority=9)
    sched._add_request_to_queue(low)
    high = h.new_req(prompt(300), session_id="high", priority=1)
    sched._add_request_to_queue(high)  # preempts "low" from the full queue
    assert sched.waiting_queue == [high]
    assert tracker.idle.inflight("low") == 0 and tracker.idle.inflight("high") == 1
    worse = h.new_req(prompt(600), session_id="worse", priority=20)
    sched._add_request_to_queue(worse)  # refused: the queue is full
    assert sched.waiting_queue == [high]
    assert tracker.idle.inflight("worse") == 0
    assert clock.advance(TTL) == 2  # "low" and "worse"; "high" is queued
    assert tracker.open_sessions() == ["high"]


# ---- /open_session timeouts kept where SGLang keeps them -----------------------------------


def test_an_open_timeout_survives_a_tree_reset_and_the_open_session_bound():
    """The session's own timeout lives with the explicit open, which a tree
    reset (flush_cache) and the open-session bound leave alone (SGLang's
    controller still holds the session): a re-open after them keeps it."""
    for how in ("reset", "bound"):
        h = make_full_cache(enable_session=True)
        tracker, clock = with_ttl(h, ttl=None)
        if how == "bound":
            tracker.max_open_sessions = 2
        h.cache.open_radix_session("t", timeout=3.0)
        run(h, arrive(h, prompt(0), "t"))
        if how == "reset":
            h.cache.reset()
        else:
            run(h, arrive(h, prompt(200), "x"))
            run(h, arrive(h, prompt(400), "y"))
        assert "t" not in tracker.generations and tracker.is_explicitly_open("t")
        run(h, arrive(h, prompt(600), "t"))  # re-opened by its next request
        assert tracker.idle.sessions["t"].ttl == 3.0
        assert clock.advance(3.0) == 1 and "t" not in tracker.generations
        # Expired by its own timeout, as SGLang's reaper ends it: a new open
        # of the id is a new session.
        assert not tracker.is_explicitly_open("t")
        h.cache.validate_session_state()


def test_a_bad_open_timeout_changes_nothing(h):
    tracker, clock = with_ttl(h, ttl=None)
    for bad in (-1.0, float("inf"), "soon"):
        with pytest.raises(SessionTTLError, match="open_session timeout"):
            h.cache.open_radix_session("t", timeout=bad)
        assert not tracker.is_explicitly_open("t") and "t" not in tracker.generations
    h.cache.open_radix_session("t", timeout=5.0)  # a good one then applies
    run(h, arrive(h, prompt(0), "t"))
    assert clock.advance(5.0) == 1


def test_a_request_from_before_an_explicit_reopen_is_counted_again_after_a_retraction(h):
    """An explicit re-open starts a new generation of the same incarnation:
    requests stamped before it still keep the session busy, also after the
    scheduler retracted and re-queued them."""
    from sglang.srt.mem_cache.common import release_kv_cache

    tracker, clock = with_ttl(h)
    run(h, arrive(h, prompt(0), "s"))
    req = arrive(h, prompt(0, 60), "s")
    h.prefill(req)
    h.cache.open_radix_session("s")  # new generation, same incarnation
    assert tracker.idle.inflight("s") == 1
    # Retraction, as schedule_batch does it: freed without an insert, reset,
    # queued again.
    release_kv_cache(req, h.cache, is_insert=False)
    del h.live_reqs[req.rid]
    req.reset_for_retract()
    req.kv = None
    assert tracker.idle.inflight("s") == 0
    h.cache.ensure_session_generation(req)
    assert tracker.idle.inflight("s") == 1
    assert clock.advance(2 * TTL) == 0  # busy: not expired under it
    run(h, req)
    assert tracker.idle.inflight("s") == 0 and clock.advance(TTL) == 1


def test_request_dropped_by_the_queue_wait_timeout_stops_keeping_its_session_busy(monkeypatch):
    import time

    monkeypatch.setenv("SGLANG_REQ_WAITING_TIMEOUT", "0.001")
    h = make_full_cache(enable_session=True)
    tracker, clock = with_ttl(h)
    sched, sent = _queue_scheduler(h)
    old = h.new_req(prompt(0), session_id="s", rid="waited-1")
    sched._add_request_to_queue(old)
    old.time_stats.wait_queue_entry_time = time.perf_counter() - 1  # waited too long
    fresh = h.new_req(prompt(300), session_id="t", rid="fresh-1")
    sched._add_request_to_queue(fresh)
    fresh.time_stats.wait_queue_entry_time = time.perf_counter() + 60
    sched._abort_on_waiting_timeout()  # SGLang drops it from the queue, no finish
    assert [r.rid for r in sched.waiting_queue] == ["fresh-1"] and len(sent) == 1
    assert tracker.idle.inflight("s") == 0 and tracker.idle.inflight("t") == 1
    assert clock.advance(TTL) == 1 and tracker.open_sessions() == ["t"]
    sched._abort_on_waiting_timeout()  # nothing due: the queue list is kept
    assert [r.rid for r in sched.waiting_queue] == ["fresh-1"]
