"""Session ids whose ``repr``/``str``/``__eq__``/``__hash__`` raise (reachable
through the Python Engine API) never get an exception of ours into the
scheduler loop (issue 12 item 9).  Every hook on the scheduler path is driven
through the real ``Scheduler`` methods and the real cache."""

import os
import sys
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from session_test_utils import SHAPES, make_scheduler, prompt  # noqa: E402

import sglang.srt.managers.schedule_batch as schedule_batch  # noqa: E402

from sglang.srt.managers.io_struct import (  # noqa: E402
    CloseSessionReqInput,
    OpenSessionReqInput,
)


def _boom(*_a, **_k):
    raise RuntimeError("hostile id")


class HostileStr(str):
    """A real string whose every protocol method raises."""

    __hash__ = _boom
    __eq__ = _boom
    __ne__ = _boom
    __repr__ = _boom
    __str__ = _boom
    __format__ = _boom
    strip = _boom


class HostileObject:
    __hash__ = _boom
    __eq__ = _boom
    __repr__ = _boom
    __str__ = _boom
    __format__ = _boom


@pytest.fixture
def h():
    harness = SHAPES["full"]()
    yield harness
    harness.cache.validate_session_state()
    harness.check()


def test_hostile_str_subclass_is_used_as_its_plain_value(h):
    sched = make_scheduler(h.cache)
    sched.open_session(OpenSessionReqInput(capacity_of_str_len=64, session_id=HostileStr("agent")))
    req = h.new_req(prompt(0), session_id=HostileStr("agent"))
    sched._add_request_to_queue(req)
    assert type(req.session_id) is str and req.session_id == "agent"
    assert req.finished_reason is None
    sched.waiting_queue.clear()
    h.prefill(req)
    h.finish(req)
    tracker = h.cache.session_ref_tracker
    assert tracker.open_sessions() == ["agent"]
    assert all(type(s) is str for s in tracker.generations)
    assert tracker.session_leaves("agent")
    sched.close_session(CloseSessionReqInput(session_id=HostileStr("agent")))
    assert tracker.counters.closed == 1 and not tracker.open_sessions()


def test_hostile_object_id_is_refused_without_raising(h, monkeypatch):
    # set_finish_with_abort asks the (absent) TP group whether to log.
    monkeypatch.setattr(schedule_batch, "get_parallel", lambda: SimpleNamespace(tp_rank=0))
    sched = make_scheduler(h.cache)
    req = h.new_req(prompt(0), session_id=HostileObject())
    sched._add_request_to_queue(req)  # no exception
    assert type(req.to_finish).__name__ == "FINISH_ABORT"
    assert "Invalid session_id" in req.to_finish.message
    assert "HostileObject" in req.to_finish.message
    sched.waiting_queue.clear()

    open_req = OpenSessionReqInput(capacity_of_str_len=64, session_id=HostileObject())
    out = sched.open_session(open_req)  # stock answers "cannot open"
    assert out is not None and out.success is False
    sched.close_session(CloseSessionReqInput(session_id=HostileObject()))
    assert h.cache.session_ref_tracker.open_sessions() == []


def test_cache_hooks_never_raise_on_hostile_ids(h):
    tracker = h.cache.session_ref_tracker
    for sid in (HostileObject(), HostileStr("x")):
        req = h.new_req(prompt(100), session_id=sid)
        h.prefill(req)
        h.finish(req)  # cache_finished_req: should_register / register / finish
    # The str subclass registers under its plain value; the object does not.
    assert tracker.open_sessions() == ["x"]
    with pytest.raises(Exception) as e:
        h.cache.release_radix_session(HostileObject())
    assert type(e.value).__name__ == "SessionRefError"  # a clear error, safe to print
    str(e.value)
    assert h.cache.release_radix_session(HostileStr("x")) >= 1
