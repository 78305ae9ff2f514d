"""The one session-id rule (session_ids.py) and its use at the tokenizer manager."""

import asyncio
import types

import pytest

from sglang_session_cache.session_ids import (
    MAX_SESSION_ID_LEN,
    generate_request_problem,
    session_id_problem,
    validate_session_id,
)

GOOD = ["a", "agent-42", "x" * MAX_SESSION_ID_LEN, "ünïcode id", "0f" * 16, " padded ",
        "family-\U0001F468\u200d\U0001F467"]  # an emoji joined by ZWJ (a format char) is fine
BAD = {
    "empty": ("", "empty string"),
    "whitespace": (" \t ", "only whitespace"),
    "none": (None, "got NoneType"),
    "int": (42, "got int"),
    "list": (["a"], "got list"),
    "long": ("x" * (MAX_SESSION_ID_LEN + 1), f"got {MAX_SESSION_ID_LEN + 1} characters"),
    "huge": ("x" * 100_000, "got 100000 characters"),
    "nul": ("a\x00b", "control character '\\x00'"),
    "newline": ("a\nb", "control character '\\n'"),
    "del": ("a\x7f", "control character '\\x7f'"),
    "c1": ("a\x85", "control character"),
    # Not encodable as UTF-8: the reply to /open_session failed after the
    # scheduler had opened the session (a 500 for an open session).
    "surrogate": ("a\ud801", "unpaired surrogate '\\ud801'"),
    "line_separator": ("a\u2028b", "line separator '\\u2028'"),
    "paragraph_separator": ("a\u2029b", "paragraph separator"),
    "bidi_override": ("user\u202eevil", "bidirectional control character '\\u202e'"),
    "bidi_isolate": ("a\u2066b", "bidirectional control character"),
    "bidi_mark": ("a\u200fb", "bidirectional control character"),
}


@pytest.mark.parametrize("sid", GOOD)
def test_good_ids_pass(sid):
    assert session_id_problem(sid) is None
    assert validate_session_id(sid) == sid


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_ids_get_one_clear_message(name):
    sid, why = BAD[name]
    problem = session_id_problem(sid)
    assert problem.startswith("Invalid session_id: session_id must be a non-empty string of at most 256")
    assert why in problem
    assert len(problem) < 400  # a 100k-character id is not echoed back
    with pytest.raises(ValueError, match="Invalid session_id"):
        validate_session_id(sid)


def test_generate_request_checks_top_level_and_session_params():
    req = types.SimpleNamespace
    assert generate_request_problem(req(session_id=None, session_params=None)) is None
    assert generate_request_problem(req(session_id="ok", session_params=None)) is None
    assert "session_id" in generate_request_problem(req(session_id="", session_params=None))
    assert generate_request_problem(req(session_id=None, session_params={"id": None})) is None
    problem = generate_request_problem(req(session_id=None, session_params={"id": "a\x00"}))
    assert problem.startswith("Invalid session_params.id")
    batch = [{"id": "ok"}, {"id": "y" * 300}]
    assert "300 characters" in generate_request_problem(req(session_id=None, session_params=batch))


def _manager(flag):
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    m = object.__new__(TokenizerManager)  # no server: only the patched entry points run
    m.server_args = types.SimpleNamespace(enable_session_radix_cache=flag)
    return m


def test_tokenizer_manager_rejects_bad_ids_before_anything_runs():
    from sglang.srt.managers.io_struct import CloseSessionReqInput, GenerateReqInput, OpenSessionReqInput

    m = _manager(True)
    gen = m.generate_request(GenerateReqInput(input_ids=[1, 2], session_id="a\x00"))
    with pytest.raises(ValueError, match="Invalid session_id.*control character"):
        asyncio.run(gen.__anext__())
    with pytest.raises(ValueError, match="Invalid session_id.*empty string"):
        asyncio.run(m.close_session(CloseSessionReqInput(session_id="")))
    with pytest.raises(ValueError, match="Invalid session_id.*characters"):
        asyncio.run(m.open_session(OpenSessionReqInput(capacity_of_str_len=10, session_id="x" * 1000)))


def test_flag_off_leaves_the_original_generator_untouched():
    from sglang.srt.managers import tokenizer_manager

    orig = tokenizer_manager.TokenizerManager.generate_request.__wrapped__
    obj = types.SimpleNamespace(session_id="a\x00", session_params=None)
    gen = _manager(False).generate_request(obj)
    assert gen.ag_code is orig.__code__  # stock generator, no proxy
    gen.aclose  # never started: nothing ran


@pytest.mark.parametrize("body", [{"input_ids": [1, 2]}, {"text": ["a", "b"]}])
def test_a_refused_stream_leaves_what_the_abort_task_reads(body):
    # SGLang's streaming /generate starts create_abort_task(obj), which reads
    # obj.is_single and obj.rid two seconds later; the original sets them
    # while normalizing, so the refusal must too (else a Traceback per stream).
    from sglang.srt.managers.io_struct import GenerateReqInput

    obj = GenerateReqInput(**body, session_id="", stream=True)
    gen = _manager(True).generate_request(obj)
    with pytest.raises(ValueError, match="Invalid session_id.*empty string"):
        asyncio.run(gen.__anext__())
    assert obj.is_single is ("input_ids" in body)
    rids = [obj.rid] if obj.is_single else obj.rid
    assert len(rids) == (1 if obj.is_single else 2) and all(rids)


def test_a_malformed_request_keeps_sglangs_own_error():
    # SGLang's own validation runs first, as on a stock server.
    from sglang.srt.managers.io_struct import GenerateReqInput

    gen = _manager(True).generate_request(GenerateReqInput(session_id=""))
    with pytest.raises(ValueError, match="Either text, input_ids or input_embeds should be provided"):
        asyncio.run(gen.__anext__())


class _CaseInsensitiveId(str):
    """An Engine API id type with its own hash and equality."""

    def __hash__(self):
        return hash(self.lower())

    def __eq__(self, other):
        return isinstance(other, str) and self.lower() == other.lower()


@pytest.mark.parametrize("flag", [True, False])
def test_str_subclass_ids_go_on_as_plain_strings(flag):
    # The scheduler keys sessions by the plain copy; a subclass with its own
    # __hash__ would miss its own entries there (the open's reply future hung).
    from sglang.srt.managers.io_struct import CloseSessionReqInput, GenerateReqInput, OpenSessionReqInput

    m = _manager(flag)
    gen_obj = GenerateReqInput(input_ids=[1, 2], session_id=_CaseInsensitiveId("Agent-7"),
                               session_params={"id": _CaseInsensitiveId("Classic-1")})
    m.generate_request(gen_obj)  # not started: only the entry point ran
    objs = [gen_obj]
    for obj in (OpenSessionReqInput(capacity_of_str_len=10, session_id=_CaseInsensitiveId("Agent-7")),
                CloseSessionReqInput(session_id=_CaseInsensitiveId("Agent-7"))):
        call = m.open_session if isinstance(obj, OpenSessionReqInput) else m.close_session
        with pytest.raises(Exception):  # no server behind: the original fails later
            asyncio.run(call(obj))
        objs.append(obj)
    plain = [type(o.session_id) is str for o in objs] + [type(gen_obj.session_params["id"]) is str]
    assert plain == [flag] * 4  # flag off: stock, untouched
    assert all(o.session_id == "Agent-7" for o in objs)
