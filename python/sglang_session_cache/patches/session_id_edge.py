"""Session ids are checked where they enter the server: the tokenizer manager.

``/generate`` (and ``Engine.generate``) reach ``TokenizerManager.generate_request``;
``/open_session`` and ``/close_session`` reach ``open_session`` / ``close_session``.
A bad id raises ``ValueError`` there, which SGLang's HTTP layer answers with
a 400 carrying the message (the SSE error event for streaming requests) --
before anything is tokenized or sent to the scheduler, so nothing is held and
the server keeps serving. Only with ``--enable-session-radix-cache``: with the
flag off the original methods run untouched (stock behaviour).
"""

from __future__ import annotations

from sglang_session_cache.patches._wrap import wrap_method
from sglang_session_cache.session_ids import generate_request_problem, session_id_problem


def _enabled(manager) -> bool:
    return bool(getattr(manager.server_args, "enable_session_radix_cache", False))


async def _rejected(obj, message: str):
    # An async generator like the original, failing on first iteration the way
    # SGLang's own validation errors do.  The request is normalized first, as
    # the original does before anything else: a streaming /generate starts a
    # background abort task that reads ``obj.is_single`` and ``obj.rid`` two
    # seconds later, and without them it logs a Traceback for every refused
    # stream.  (An error of the normalization itself wins, as in stock.)
    obj.normalize_batch_and_arguments()
    raise ValueError(message)
    yield  # pragma: no cover - makes this an async generator


def _plain(session_id):
    # A ``str`` subclass id (Engine API) becomes an exact ``str``: the
    # scheduler keys sessions by the plain copy, and a subclass with its own
    # ``__hash__``/``__eq__`` would then miss its own entries (the open's
    # reply future, the classic session of its ``session_params``).
    return str.__str__(session_id) if isinstance(session_id, str) else session_id


def _plain_session_params(params) -> None:
    for item in params if isinstance(params, list) else [params]:
        if isinstance(item, dict) and item.get("id") is not None:
            item["id"] = _plain(item["id"])


def _wrap_generate_request(orig):
    def generate_request(self, obj, request=None):
        if _enabled(self):
            problem = generate_request_problem(obj)
            if problem is not None:
                return _rejected(obj, problem)
            if getattr(obj, "session_id", None) is not None:
                obj.session_id = _plain(obj.session_id)
            _plain_session_params(getattr(obj, "session_params", None))
        return orig(self, obj, request)  # the original generator, not a proxy

    return generate_request


def _wrap_open_session(orig):
    async def open_session(self, obj, request=None):
        if _enabled(self) and obj.session_id is not None:
            problem = session_id_problem(obj.session_id)
            if problem is not None:
                raise ValueError(problem)
            obj.session_id = _plain(obj.session_id)
        return await orig(self, obj, request)

    return open_session


def _wrap_close_session(orig):
    async def close_session(self, obj, request=None):
        if _enabled(self):
            problem = session_id_problem(obj.session_id)
            if problem is not None:
                raise ValueError(problem)
            obj.session_id = _plain(obj.session_id)
        return await orig(self, obj, request)

    return close_session


def apply_tokenizer_manager(module) -> None:
    cls = module.TokenizerManager
    wrap_method(cls, "generate_request", _wrap_generate_request)
    wrap_method(cls, "open_session", _wrap_open_session)
    wrap_method(cls, "close_session", _wrap_close_session)
