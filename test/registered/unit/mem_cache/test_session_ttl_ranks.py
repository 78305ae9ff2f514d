"""TTL expiry is the same on every TP/PP rank (issue 12 item 1).

Two ranks, each a real UnifiedRadixCache behind a real ``Scheduler``, get the
same scheduler-ordered events: batches polled by the real
``SchedulerRequestReceiver._broadcast_reqs_across_ranks`` on the source rank
(pickled as ``broadcast_pyobj`` does) and consumed by each rank's real
``process_input_requests``, arrivals through ``_add_request_to_queue``, then
prefill/decode/finish/evict.  Each rank runs under its own skewed, jittering
local clock (``time.monotonic``/``time.time``/``time.perf_counter``); the trees,
open sessions, expiries and evictions must stay identical after every step."""

import contextlib
import os
import pickle
import random
import sys
import time
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from session_test_utils import SHAPES, arrive, make_scheduler  # noqa: E402

from sglang.srt.managers.io_struct import CloseSessionReqInput, OpenSessionReqInput  # noqa: E402

from sglang.srt.managers.scheduler_components.request_receiver import (  # noqa: E402
    SchedulerRequestReceiver,
)
from sglang_session_cache.patches import session_clock  # noqa: E402
from sglang_session_cache.session_idle import SharedClockTick  # noqa: E402

TTL = 10.0


@contextlib.contextmanager
def local_clock(offset: float, rng: random.Random):
    """This rank's own clock: skewed by ``offset`` and jittering per read."""
    real = (time.monotonic, time.time, time.perf_counter)
    base = real[0]()

    def fake():
        return base + offset + rng.random() * 0.05

    time.monotonic = time.time = time.perf_counter = fake
    try:
        yield
    finally:
        time.monotonic, time.time, time.perf_counter = real


def source_receiver():
    """The real receiver on the rank that reads the tokenizer socket (TP=1
    here: the broadcast itself is SGLang's pickle of the same list)."""
    fields = {f: None for f in SchedulerRequestReceiver.__dataclass_fields__}
    fields.update(
        ps=SimpleNamespace(pp_rank=0, tp_size=1, attn_tp_size=1, attn_cp_size=1),
        server_args=SimpleNamespace(
            enable_dp_attention=False, enable_session_radix_cache=True, language_only=False
        ),
        max_recv_per_poll=-1,
    )
    return SchedulerRequestReceiver(**fields)


class Rank:
    def __init__(self, shape, offset, seed):
        self.h = SHAPES[shape]()
        self.h.cache.session_ref_tracker.set_ttl(TTL)
        self.sched = make_scheduler(self.h.cache)
        # What process_input_requests touches besides the dispatcher.
        self.sched.flush_wrapper = SimpleNamespace(check_pending=lambda: None)
        self.sched.external_corpus_manager = None
        self.offset = offset
        self.rng = random.Random(seed)
        self.live = {}

    def clock(self):
        return local_clock(self.offset, self.rng)

    def deliver(self, wire: bytes):
        with self.clock():
            self.sched.process_input_requests(pickle.loads(wire))

    def signature(self):
        cache = self.h.cache
        tracker = cache.session_ref_tracker
        nodes = []
        stack = [(cache.root_node, ())]
        while stack:
            node, path = stack.pop()
            for child in node.children.values():
                p = path + tuple(child.key.token_ids)
                refs = tuple(child.component_data[ct].session_ref for ct in tracker.components)
                nodes.append((p, refs))
                stack.append((child, p))
        return (
            sorted(nodes),
            sorted(tracker.generations.items()),
            tracker.counters,
            tracker.now,
            self.h.available(),
        )


@pytest.mark.parametrize("shape", list(SHAPES))
def test_ranks_with_different_clocks_keep_identical_trees(shape, monkeypatch):
    seed = 1234
    rng = random.Random(seed)
    # Source-rank time: moves by random steps (a TTL is 10 s).
    source_t = [5000.0]
    monkeypatch.setattr(session_clock.time, "monotonic", lambda: source_t[0])
    monkeypatch.setattr(session_clock, "_last_tick", [float("-inf")])
    receiver = source_receiver()
    ranks = [Rank(shape, 0.0, 1), Rank(shape, 3.7, 2)]  # rank 1 runs 3.7 s ahead
    sessions = [f"s{i}" for i in range(5)]
    expiries = 0
    try:
        for step in range(400):
            op = rng.random()
            if op < 0.35:  # a poll: the source stamps the batch once
                source_t[0] += rng.choice([0.3, 1.0, 2.5, 6.0])
                batch = receiver._broadcast_reqs_across_ranks([])
                assert [type(x) for x in batch] == [SharedClockTick]
                wire = pickle.dumps(batch)
                before = ranks[0].h.cache.session_ref_tracker.counters.expired
                for r in ranks:
                    r.deliver(wire)
                expiries += ranks[0].h.cache.session_ref_tracker.counters.expired - before
            elif op < 0.6 and len(ranks[0].live) < 4:  # an arrival, then prefill
                sid = rng.choice(sessions)
                base = sessions.index(sid) * 1000
                n = rng.randrange(8, 40)
                rid = f"r{step}"
                for r in ranks:
                    with r.clock():
                        req = r.h.new_req(list(range(base, base + n)), session_id=sid, rid=rid)
                        r.sched._add_request_to_queue(req)
                        r.sched.waiting_queue.clear()
                        r.h.prefill(req)
                        r.live[rid] = req
            elif op < 0.8 and ranks[0].live:  # decode one, or finish one
                rid = rng.choice(sorted(ranks[0].live))
                finish = rng.random() < 0.5
                for r in ranks:
                    with r.clock():
                        req = r.live[rid]
                        if finish:
                            r.h.finish(req)
                            del r.live[rid]
                        else:
                            r.h.decode(req, 1)
            elif op < 0.9:  # memory pressure
                k = rng.randrange(1, 48)
                results = []
                for r in ranks:
                    with r.clock():
                        results.append(r.h.evict(num_tokens=k))
                assert results[0] == results[1], (step, results)
            else:  # the metrics path (log line / Prometheus) reads state
                for r in ranks:
                    with r.clock():
                        r.h.cache.session_metrics()
            a, b = (r.signature() for r in ranks)
            assert a == b, f"ranks diverged at step {step} (seed {seed})"
        for r in ranks:
            r.h.cache.validate_session_state()
            r.h.check()
    finally:
        for r in ranks:
            for req in list(r.live.values()):
                r.h.finish(req)
    assert expiries > 0  # the sequence does exercise expiry


def test_flag_off_batches_carry_no_tick(monkeypatch):
    monkeypatch.setattr(session_clock, "_last_tick", [float("-inf")])
    receiver = source_receiver()
    object.__setattr__(
        receiver,
        "server_args",
        SimpleNamespace(enable_dp_attention=False, enable_session_radix_cache=False),
    )
    batch = []
    assert receiver._broadcast_reqs_across_ranks(batch) is batch == []


def test_ticks_are_rate_limited_on_idle_polls(monkeypatch):
    t = [100.0]
    monkeypatch.setattr(session_clock.time, "monotonic", lambda: t[0])
    monkeypatch.setattr(session_clock, "_last_tick", [float("-inf")])
    receiver = source_receiver()
    assert len(receiver._broadcast_reqs_across_ranks([])) == 1
    t[0] += session_clock.TICK_INTERVAL_S / 2
    assert receiver._broadcast_reqs_across_ranks([]) == []  # idle, too soon
    sentinel = object()
    out = receiver._broadcast_reqs_across_ranks([sentinel])  # requests: always
    assert out[0] is sentinel and type(out[1]) is SharedClockTick and out[1].t == t[0]
    # Later PP stages and non-source ranks add nothing.
    object.__setattr__(receiver, "ps", SimpleNamespace(pp_rank=1, tp_size=1))
    t[0] += 10
    assert receiver._broadcast_reqs_across_ranks([]) == []


def test_process_input_requests_hides_ticks_and_keeps_the_batch(monkeypatch):
    """SGLang never sees a tick; the batch PP forwards to the next stage
    keeps it."""
    h = SHAPES["full"]()
    sched = make_scheduler(h.cache)
    seen = []
    monkeypatch.setattr(
        type(sched).process_input_requests, "__wrapped__", None, raising=False
    )
    from sglang_session_cache.patches.session_clock import _wrap_process_input_requests

    wrapped = _wrap_process_input_requests(lambda self, reqs: seen.append(list(reqs)))
    marker = object()
    batch = [marker, SharedClockTick(42.0)]
    wrapped(sched, batch)
    assert seen == [[marker]]
    assert batch[1].t == 42.0 and len(batch) == 2
    assert h.cache.session_ref_tracker.now == 42.0


@contextlib.contextmanager
def rank_time(t: float):
    """This rank's own clock reads ``t`` (SGLang's session reaper reads it)."""
    real = time.monotonic
    time.monotonic = lambda: t
    try:
        yield
    finally:
        time.monotonic = real


def test_reopen_while_the_reaper_has_run_on_one_rank_only(monkeypatch):
    """SGLang's session controller reaps a timed-out ``/open_session``
    session on each rank's own clock, at most once a second, so for a moment
    one rank has reaped it and another has not.  A re-open arriving then must
    do the same on every rank: the decision comes from the tracker (whose
    copy of the timeout runs on the shared clock), not from the controller."""
    source_t = [5000.0]
    monkeypatch.setattr(session_clock.time, "monotonic", lambda: source_t[0])
    monkeypatch.setattr(session_clock, "_last_tick", [float("-inf")])
    receiver = source_receiver()
    ranks = [Rank("full", 0.0, 1), Rank("full", 0.0, 2)]
    for r in ranks:
        r.h.cache.session_ref_tracker.set_ttl(None)  # only the session's own timeout

    def poll(local_times):
        source_t[0] += 0.5
        wire = pickle.dumps(receiver._broadcast_reqs_across_ranks([]))
        for r, t in zip(ranks, local_times):
            with rank_time(t):
                r.sched.process_input_requests(pickle.loads(wire))

    def open_agent():
        for r in ranks:
            with rank_time(100.0):
                r.sched.open_session(OpenSessionReqInput(
                    capacity_of_str_len=64, session_id="agent", timeout=5.0))

    poll([99.0, 99.0])  # the shared clock starts
    open_agent()
    gen = [r.h.cache.session_ref_tracker.generations["agent"] for r in ranks]
    for r in ranks:
        req = arrive(r.h, list(range(40)), "agent")
        r.h.prefill(req, finishing=True)
        r.h.finish(req)
    # Both reaper checks run (nothing timed out); rank 1 polls 0.6 s later.
    poll([104.4, 105.0])
    # Rank 0's reaper runs again and closes the timed-out controller session;
    # rank 1's last check was under a second ago, so it still has it.
    poll([105.6, 105.6])
    assert "agent" not in ranks[0].sched.session_controller.sessions
    assert "agent" in ranks[1].sched.session_controller.sessions
    open_agent()  # the client re-opens: the same request reaches both ranks
    assert [r.h.cache.session_ref_tracker.generations["agent"] for r in ranks] == gen
    a, b = (r.signature() for r in ranks)
    assert a == b
    assert ranks[0].h.cache.session_ref_tracker.session_leaves("agent")
    for r in ranks:
        r.h.cache.validate_session_state()


def test_duplicate_open_starts_no_new_generation_and_a_close_ends_it():
    h = SHAPES["full"]()
    sched = make_scheduler(h.cache)
    tracker = h.cache.session_ref_tracker
    def open_():
        return sched.open_session(OpenSessionReqInput(capacity_of_str_len=64, session_id="s"))

    assert open_().success
    gen = tracker.generations["s"]
    assert tracker.is_explicitly_open("s")
    assert not open_().success  # SGLang refuses: already open
    assert tracker.generations["s"] == gen
    sched.close_session(CloseSessionReqInput(session_id="s"))
    assert not tracker.is_explicitly_open("s")
    open_()
    assert tracker.generations["s"] > gen and tracker.is_explicitly_open("s")
    # An id a request opened implicitly is not explicitly open: /open_session
    # on it starts a new generation, as before.
    arrive(h, [1, 2, 3], "implicit")
    implicit = tracker.generations["implicit"]
    assert not tracker.is_explicitly_open("implicit")
    sched.open_session(OpenSessionReqInput(capacity_of_str_len=64, session_id="implicit"))
    assert tracker.generations["implicit"] > implicit
    tracker.validate_session_state()


def test_an_open_sglang_refuses_changes_nothing_whatever_the_tracker_dropped():
    """SGLang's controller keeps an explicitly opened session until it is
    closed or its own timeout passes; the global TTL, the open-session bound
    and a cache flush do not end it there.  An open it refuses then must not
    start a new generation (in-flight turns would register nothing)."""
    from sglang.srt.managers.io_struct import OpenSessionReqInput

    h = SHAPES["full"]()
    sched = make_scheduler(h.cache)
    tracker = h.cache.session_ref_tracker
    tracker.set_ttl(10.0)

    def open_(sid, **kw):
        return sched.open_session(OpenSessionReqInput(capacity_of_str_len=64, session_id=sid, **kw))

    assert open_("s").success
    h.cache.advance_session_clock(100.0)  # the global TTL expires it in the tracker only
    assert "s" not in tracker.generations and tracker.is_explicitly_open("s")
    req = arrive(h, list(range(30)), "s")  # a turn reopens it implicitly
    gen = tracker.generations["s"]
    assert not open_("s").success  # SGLang: "already exist"
    assert tracker.generations["s"] == gen
    h.prefill(req, finishing=True)
    h.finish(req)
    assert tracker.session_leaves("s")  # the turn registered
    # A streaming id opened again without streaming: refused, nothing opened.
    assert open_("st", streaming=True).success is not False
    open_("st")
    assert "st" not in tracker.generations
    # Its own open timeout ends it on the controller too: a later open re-opens.
    assert open_("own", timeout=5.0).success
    h.cache.advance_session_clock(200.0)
    assert not tracker.is_explicitly_open("own")
    # A close ends it as well.
    sched.close_session(CloseSessionReqInput(session_id="s"))
    assert not tracker.is_explicitly_open("s")
    tracker.validate_session_state()
