"""Session lifecycle semantics on the real UnifiedRadixCache: classic
``/open_session`` sessions, upstream-compatible calls, and the rule that a
session's reference follows its newest turn."""

import os
import sys
from array import array
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from cache_fixtures import make_full_cache, publish_server_args  # noqa: E402
from session_test_utils import SHAPES, arrive, done, finish, make_scheduler  # noqa: E402

import sglang.srt.managers.schedule_batch as schedule_batch  # noqa: E402
from sglang.srt.managers.io_struct import (  # noqa: E402
    CloseSessionReqInput,
    OpenSessionReqInput,
    SessionParams,
    TokenizedGenerateReqInput,
)
from sglang.srt.mem_cache.unified_cache_components import ComponentType  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang_session_cache.patches.server_wiring import _request_left  # noqa: E402
from sglang_session_cache.session_tracker import SessionRefError  # noqa: E402

FULL = ComponentType.FULL
SYSTEM = list(range(1000, 1040))


@pytest.fixture
def server_args():
    args = publish_server_args()
    saved = args.enable_session_radix_cache
    args.enable_session_radix_cache = True
    yield args
    args.enable_session_radix_cache = saved


@pytest.fixture(params=list(SHAPES))
def h(request):
    harness = SHAPES[request.param]()
    yield harness
    harness.cache.validate_session_state()


def tracker(h):
    return h.cache.session_ref_tracker


def referenced_ids(h, sid, ct=FULL):
    """Nodes ``sid`` protects (the fixture's validator checks the stored
    counts against the same leaf index)."""
    coverage = tracker(h).components[ct].coverage()
    return {n.id for n, per_session in coverage.items() if sid in per_session}


# ---- issue 11 item 1: classic sessions ----------------------------------------


def classic_req(sched, sid, tokens, rid, parent_rid=None, queue=True):
    """What Scheduler.handle_generate_request does for session_params={"id": sid}:
    the SessionController session builds the Req (no top-level session_id),
    and the scheduler queues it (``queue=False``: later, as a request waiting
    for its grammar).  Run through this package's wrapper of that method, with
    the SGLang part (which needs a model and a tokenizer) done here."""
    from sglang_session_cache.patches.server_wiring import _wrap_handle_generate_request

    created = []

    def create_and_queue(sched, recv):
        req = sched.session_controller.get(sid).create_req(recv, None, vocab_size=1 << 20)
        if queue:
            sched._add_request_to_queue(req)
        created.append(req)

    recv = TokenizedGenerateReqInput(
        rid=rid,
        input_text="",
        input_ids=array("q", tokens),
        input_embeds=None,
        mm_inputs=None,
        token_type_ids=None,
        sampling_params=SamplingParams(max_new_tokens=64, ignore_eos=True),
        return_logprob=False,
        logprob_start_len=-1,
        top_logprobs_num=0,
        token_ids_logprob=None,
        stream=False,
        session_params=SessionParams(id=sid, rid=parent_rid),
    )
    _wrap_handle_generate_request(create_and_queue)(sched, recv)
    return created[0]


def test_classic_session_requests_register_references(server_args):
    h = make_full_cache(enable_session=True)
    sched = make_scheduler(h.cache, server_args)
    out = sched.open_session(OpenSessionReqInput(capacity_of_str_len=64, session_id="cl"))
    assert out.success

    req = classic_req(sched, "cl", SYSTEM + [1, 2, 3], "cl-1")
    assert req.session_id is None and req.session is not None
    gen = tracker(h).generations["cl"]
    assert req.session_ref_generation == gen  # stamped on arrival
    finish(h, req)
    assert tracker(h).counters.registered == 1
    assert tracker(h).session_leaves("cl")

    # The next turn continues from the first one through the controller.
    req2 = classic_req(sched, "cl", [7, 8, 9], "cl-2", parent_rid="cl-1")
    finish(h, req2)
    assert len(tracker(h).session_leaves("cl")) == 1

    sched.close_session(CloseSessionReqInput(session_id="cl"))
    assert "cl" not in tracker(h).open_sessions()
    assert not referenced_ids(h, "cl")
    assert "cl" not in sched.session_controller
    h.cache.validate_session_state()


def test_classic_session_in_flight_at_close_registers_nothing(server_args):
    h = make_full_cache(enable_session=True)
    sched = make_scheduler(h.cache, server_args)
    sched.open_session(OpenSessionReqInput(capacity_of_str_len=64, session_id="cl"))
    req = classic_req(sched, "cl", SYSTEM + [4, 5], "late")
    h.prefill(req)
    sched.close_session(CloseSessionReqInput(session_id="cl"))
    h.decode(req, 2)
    h.finish(req)
    assert not referenced_ids(h, "cl")
    assert tracker(h).counters.late_finish_skipped == 1


def test_streaming_classic_session_stays_excluded(server_args, monkeypatch):
    monkeypatch.setattr(schedule_batch, "get_parallel", lambda: SimpleNamespace(tp_rank=0))
    h = make_full_cache(enable_session=True)
    sched = make_scheduler(h.cache, server_args)
    sched.open_session(
        OpenSessionReqInput(capacity_of_str_len=64, session_id="st", streaming=True)
    )
    req = classic_req(sched, "st", SYSTEM + [1], "st-1")
    assert getattr(req, "session_ref_generation", None) is None
    assert not tracker(h).should_register(req)
    assert "st" not in tracker(h).open_sessions()


def _streaming_session_with_timeout(server_args, monkeypatch):
    """A scheduler with streaming session "st" opened at shared-clock 100
    with a 5 s timeout."""
    monkeypatch.setattr(schedule_batch, "get_parallel", lambda: SimpleNamespace(tp_rank=0))
    h = make_full_cache(enable_session=True)
    h.cache.advance_session_clock(100.0)
    sched = make_scheduler(h.cache, server_args)
    sched.open_session(OpenSessionReqInput(
        capacity_of_str_len=64, session_id="st", streaming=True, timeout=5.0))
    return h, tracker(h), sched


def test_a_streaming_sessions_own_timeout_ends_its_open(server_args, monkeypatch):
    """SGLang's reaper ends a streaming session its timeout after its last
    request; the tracker forgets it then too (on the shared clock), so the id
    can be opened again -- here as a regular session, whose requests count."""
    h, t, sched = _streaming_session_with_timeout(server_args, monkeypatch)
    h.cache.advance_session_clock(103.0)
    req = classic_req(sched, "st", SYSTEM + [1], "st-1")  # its timeout restarts
    assert getattr(req, "session_ref_generation", None) is None
    h.prefill(req)
    done(h, req)  # nothing in flight when it is due
    h.cache.advance_session_clock(107.9)
    assert t.is_explicitly_open("st") and "st" in t.streaming
    h.cache.advance_session_clock(108.0)
    assert not t.is_explicitly_open("st") and "st" not in t.streaming
    # SGLang's reaper (its own clock) ends the controller session as well.
    sched.session_controller.sessions.pop("st")
    assert sched.open_session(OpenSessionReqInput(capacity_of_str_len=64, session_id="st")).success
    req = classic_req(sched, "st", SYSTEM + [2], "st-2")
    assert req.session_ref_generation == t.generations["st"]
    finish(h, req)
    assert t.session_leaves("st")
    h.cache.validate_session_state()


def test_a_requeued_streaming_request_does_not_restart_its_timeout(server_args, monkeypatch):
    # SGLang restarts the timeout when its controller creates a request, not
    # when a retracted or preempted one is queued again.
    h, t, sched = _streaming_session_with_timeout(server_args, monkeypatch)
    h.cache.advance_session_clock(101.0)
    req = classic_req(sched, "st", SYSTEM + [1], "st-1")  # due at 106
    h.cache.advance_session_clock(104.0)
    sched.waiting_queue.clear()
    sched._add_request_to_queue(req, is_retracted=True)  # queued again
    sched.waiting_queue.clear()
    _request_left(sched, req)  # and gone before it is due
    h.cache.advance_session_clock(106.0)
    assert not t.is_explicitly_open("st") and "st" not in t.streaming


def test_an_open_timeout_runs_without_requests_and_zero_is_a_timeout(server_args):
    """SGLang's reaper ends an /open_session'ed session its timeout after the
    open (top-level session_id requests do not restart it), whether or not a
    tree reset released the tracker's session meanwhile; 0 ends it at once."""
    h = make_full_cache(enable_session=True)
    t = tracker(h)
    h.cache.advance_session_clock(100.0)
    sched = make_scheduler(h.cache, server_args)
    sched.open_session(OpenSessionReqInput(capacity_of_str_len=64, session_id="t", timeout=3.0))
    sched.open_session(OpenSessionReqInput(capacity_of_str_len=64, session_id="z", timeout=0))
    finish(h, arrive(h, SYSTEM + [1], "t"))
    h.cache.reset()  # flush_cache: the tracker's session goes, SGLang's stays
    assert t.is_explicitly_open("t")
    h.cache.advance_session_clock(103.0)
    assert not t.is_explicitly_open("t") and not t.is_explicitly_open("z")
    # SGLang's reaper closed both; opened again without a timeout, "t" is a
    # new session that never expires by the old one.
    sched.session_controller.sessions.clear()
    sched.open_session(OpenSessionReqInput(capacity_of_str_len=64, session_id="t"))
    gen = t.generations["t"]
    finish(h, arrive(h, SYSTEM + [2], "t"))
    assert t.idle.sessions["t"].ttl is None
    h.cache.advance_session_clock(10_000.0)
    assert t.generations["t"] == gen and t.is_explicitly_open("t")
    h.cache.validate_session_state()


def test_a_streaming_session_with_a_request_in_flight_ends_after_it(server_args, monkeypatch):
    """SGLang defers ending a streaming session (its timeout or a close)
    while its request runs; the id stays explicitly open until then, so an
    open meanwhile is refused on both sides."""
    for how in ("timeout", "close"):
        h, t, sched = _streaming_session_with_timeout(server_args, monkeypatch)
        req = classic_req(sched, "st", SYSTEM + [1], "st-1")  # due at 105
        h.prefill(req)
        if how == "close":
            sched.close_session(CloseSessionReqInput(session_id="st"))
        h.cache.advance_session_clock(106.0)
        assert t.is_explicitly_open("st") and "st" in t.streaming
        assert sched.session_controller.get("st") is not None  # SGLang deferred it too
        done(h, req)
        assert t.is_explicitly_open("st")  # until SGLang's next reap (the next tick)
        h.cache.advance_session_clock(106.5)
        assert not t.is_explicitly_open("st") and "st" not in t.streaming
        assert not t.streaming_busy and not t.ending
        h.cache.validate_session_state()


def test_a_retracted_streaming_request_keeps_its_closing_session(server_args, monkeypatch):
    from sglang.srt.mem_cache.common import release_kv_cache

    h, t, sched = _streaming_session_with_timeout(server_args, monkeypatch)
    req = classic_req(sched, "st", SYSTEM + [1], "st-1")
    sched.waiting_queue.clear()
    h.prefill(req)
    sched.close_session(CloseSessionReqInput(session_id="st"))  # deferred: it runs
    # Retracted (freed without an insert, reset) and queued again: in flight.
    release_kv_cache(req, h.cache, is_insert=False)
    del h.live_reqs[req.rid]
    req.reset_for_retract()
    sched._add_request_to_queue(req, is_retracted=True)
    h.cache.advance_session_clock(101.0)
    assert t.is_explicitly_open("st") and t.ending == {"st": False}
    sched.waiting_queue.clear()
    h.prefill(req)
    done(h, req)
    h.cache.advance_session_clock(102.0)
    assert not t.is_explicitly_open("st") and not t.ending and not t.streaming_busy


def test_a_refused_streaming_request_detached_from_its_session_still_ends(
        server_args, monkeypatch):
    # SGLang refuses a second request while one runs ("already has an active
    # request") and detaches it from the session when it is scheduled
    # (req.session = None); its finish still counts.
    h, t, sched = _streaming_session_with_timeout(server_args, monkeypatch)
    first = classic_req(sched, "st", SYSTEM + [1], "st-1")
    sched.waiting_queue.clear()
    h.prefill(first)
    done(h, first)
    running = classic_req(sched, "st", [2, 3], "st-2")
    sched.waiting_queue.clear()
    h.prefill(running)
    refused = classic_req(sched, "st", [4], "st-3")
    sched.waiting_queue.clear()
    assert refused.to_finish is not None
    h.prefill(refused, finishing=True)
    assert refused.session is None  # detached by SGLang
    refused.finished_reason, refused.to_finish = refused.to_finish, None
    h.finish(refused)
    done(h, running)
    assert not t.streaming_busy
    sched.close_session(CloseSessionReqInput(session_id="st"))
    h.cache.advance_session_clock(101.0)
    assert not t.is_explicitly_open("st") and "st" not in t.streaming
    h.cache.validate_session_state()


def test_a_request_waiting_for_its_grammar_restarts_the_timeout_when_created(
        server_args, monkeypatch):
    h, t, sched = _streaming_session_with_timeout(server_args, monkeypatch)
    h.cache.advance_session_clock(104.0)
    req = classic_req(sched, "st", SYSTEM + [1], "st-1", queue=False)  # due at 109
    h.cache.advance_session_clock(105.5)
    assert t.is_explicitly_open("st")  # not 105: the open's own deadline
    sched._add_request_to_queue(req)  # grammar ready: queued now, not created again
    h.cache.advance_session_clock(108.9)
    assert t.is_explicitly_open("st")
    sched.waiting_queue.clear()
    _request_left(sched, req)  # it leaves (aborted) before running
    h.cache.advance_session_clock(109.0)
    assert not t.is_explicitly_open("st")


def test_a_regular_open_of_a_streaming_id_tracks_it(h):
    t = tracker(h)
    h.cache.open_radix_session("st", streaming=True, timeout=5.0)
    t.release_radix_session("st")  # closed: a new open of the id
    h.cache.open_radix_session("st", streaming=True)  # no timeout this time
    assert not t.open_timeouts.sessions
    t.explicit.pop("st")  # as when SGLang's controller no longer holds it
    h.cache.open_radix_session("st")  # regular now: not streaming any more
    assert "st" not in t.streaming and "st" in t.generations


# ---- issue 11 item 6: upstream-compatible calls ---------------------------------


def test_ensure_session_generation_accepts_an_id_or_a_request():
    h = make_full_cache(enable_session=True)
    cache = h.cache
    gen = cache.ensure_session_generation("agent")
    assert isinstance(gen, int) and cache.session_refs.generations["agent"] == gen
    assert cache.ensure_session_generation("agent") == gen  # no new generation
    req = h.new_req(SYSTEM, session_id="agent")
    assert cache.ensure_session_generation(req) == gen
    assert req.session_ref_generation == gen
    with pytest.raises(SessionRefError):
        cache.ensure_session_generation("")
    # Flag off: inert for both forms.
    off = make_full_cache(enable_session=False).cache
    assert off.ensure_session_generation("agent") is None
    assert off.ensure_session_generation(h.new_req(SYSTEM, session_id="agent")) is None


def test_session_refs_is_the_tracker():
    h = make_full_cache(enable_session=True)
    assert h.cache.session_refs is h.cache.session_ref_tracker
    assert make_full_cache(enable_session=False).cache.session_refs is None


def test_reopening_an_open_session_starts_a_new_generation(h):
    t = tracker(h)
    g1 = h.cache.open_radix_session("s")
    old = arrive(h, SYSTEM + [1, 2], "s")
    h.prefill(old)
    done = finish(h, arrive(h, SYSTEM + [3, 4], "s"))
    held = t.session_leaves("s")
    assert held and done.session_ref_generation == g1

    g2 = h.cache.open_radix_session("s")
    assert g2 != g1 and t.generations["s"] == g2
    assert t.session_leaves("s") == held  # references survive the re-open
    h.decode(old, 2)
    h.finish(old)  # in flight from generation g1: stale
    assert t.counters.stale_rejected == 1
    assert t.session_leaves("s") == held
    new = finish(h, arrive(h, SYSTEM + [5, 6], "s"))
    assert new.session_ref_generation == g2


def test_scheduler_open_of_an_existing_controller_session_changes_nothing(server_args):
    h = make_full_cache(enable_session=True)
    sched = make_scheduler(h.cache, server_args)
    sched.open_session(OpenSessionReqInput(capacity_of_str_len=64, session_id="x"))
    gen = tracker(h).generations["x"]
    # SessionController refuses the duplicate; the generation must not move.
    sched.open_session(OpenSessionReqInput(capacity_of_str_len=64, session_id="x"))
    assert tracker(h).generations["x"] == gen
    # A radix-native id (not in the controller) re-opened explicitly: new generation.
    g = h.cache.ensure_session_generation("native")
    sched.open_session(OpenSessionReqInput(capacity_of_str_len=64, session_id="native"))
    assert tracker(h).generations["native"] != g


# ---- issue 12 item 4: the reference follows the newest turn ---------------------


def test_rerendered_turns_leave_only_the_newest_branch(h):
    """Six turns that do not extend the previous one (reasoning stripped):
    the session holds one leaf, the stale branches are unreferenced."""
    t = tracker(h)
    branches = []
    for turn in range(6):
        req = finish(h, arrive(h, SYSTEM + [2000 + 100 * turn + i for i in range(8)], "s"))
        branches.append(req)
        for ct in t.components:
            assert len(t.session_leaves("s", ct)) == 1, (turn, ct)
    # Only the last turn's path (plus the shared system prompt) is referenced.
    last_leaf = next(iter(t.session_leaves("s")))
    path = set()
    node = last_leaf
    while node is not h.cache.root_node:
        path.add(node.id)
        node = node.parent
    assert referenced_ids(h, "s") == path


def test_concurrent_branches_are_kept_until_a_later_turn(h):
    t = tracker(h)
    a = arrive(h, SYSTEM + [1, 1, 1, 1, 1, 1], "s")
    b = arrive(h, SYSTEM + [2, 2, 2, 2, 2, 2], "s")
    h.prefill(a)
    h.prefill(b)
    h.decode(b, 2)
    h.finish(b)
    h.decode(a, 2)
    h.finish(a)  # arrived before b registered: does not displace it
    assert len(t.session_leaves("s")) == 2
    # A turn that arrives after both finished supersedes both.
    finish(h, arrive(h, SYSTEM + [3, 3, 3, 3, 3, 3], "s"))
    for ct in t.components:
        assert len(t.session_leaves("s", ct)) == 1, ct


def test_a_turn_supersedes_leaves_registered_before_it_arrived(h):
    t = tracker(h)
    finish(h, arrive(h, SYSTEM + [9] * 6, "s"))
    first = set(t.session_leaves("s"))
    a = arrive(h, SYSTEM + [1] * 6, "s")
    b = arrive(h, SYSTEM + [2] * 6, "s")
    h.prefill(a)
    h.prefill(b)
    h.decode(a, 1)
    h.finish(a)  # the leaf from before a arrived is gone
    assert not first & t.session_leaves("s")
    h.decode(b, 1)
    h.finish(b)  # a registered after b arrived: kept
    assert len(t.session_leaves("s")) == 2


def test_sessions_do_not_supersede_each_other(h):
    t = tracker(h)
    finish(h, arrive(h, SYSTEM + [1] * 6, "x"))
    finish(h, arrive(h, SYSTEM + [2] * 6, "y"))
    finish(h, arrive(h, SYSTEM + [1] * 6, "y"))  # identical prompt, other session
    assert len(t.session_leaves("x")) == 1
    assert len(t.session_leaves("y")) == 1


def test_validator_catches_a_superseded_leaf_kept(h):
    from sglang_session_cache.component_refs import SessionStateError

    t = tracker(h)
    a = arrive(h, SYSTEM + [1] * 6, "s")
    b = arrive(h, SYSTEM + [2] * 6, "s")
    finish(h, a)
    finish(h, b)
    refs = t.components[FULL]
    (la, ta), (lb, tb) = sorted(refs.leaves["s"].items(), key=lambda kv: kv[1])
    # Pretend a's leaf was registered before b arrived, yet survived b.
    refs.leaves["s"][la] = (tb[1] - 1, ta[1])
    with pytest.raises(SessionStateError, match="before a newer turn arrived"):
        refs.validate(h.tree_nodes())
    refs.leaves["s"][la] = ta
