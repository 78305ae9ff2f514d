"""The one rule for session ids, shared by the HTTP edge and the cache tracker.

A session id is a ``str`` that

* is not empty and not whitespace-only,
* has at most ``MAX_SESSION_ID_LEN`` (256) characters,
* contains no control character (Unicode category ``Cc``: NUL, ``\\n``,
  ``\\t``, DEL, C1 controls, ...), no line or paragraph separator
  (U+2028, U+2029), no bidirectional control (Unicode's Bidi_Control:
  U+061C, U+200E, U+200F, U+202A-U+202E, U+2066-U+2069) and no unpaired
  surrogate.

256 leaves room for UUIDs, agent/run/task compound names and hashes, while an
id can no longer grow a server's session bookkeeping without bound. Control
characters, separators and bidirectional controls are refused because ids end
up in logs and metrics labels (they break or reorder log lines); an unpaired
surrogate (JSON ``"\\ud801"``) cannot be encoded as UTF-8, so a reply or log
line carrying it would fail after the scheduler had already acted on it.

``session_id_problem`` returns a message for a bad id (``None`` for a good
one); the message is what clients see in the HTTP 400 body.
"""

from __future__ import annotations

import unicodedata
from typing import Any, Optional

MAX_SESSION_ID_LEN = 256
#: Ids of ended sessions a cache remembers, oldest forgotten first: the
#: closed-id tombstones (``session_tracker``) and the request counts of
#: sessions that lapsed without a close (``protection_policy``).  At
#: ``MAX_SESSION_ID_LEN`` characters each this stays under ~2 MB.
ENDED_IDS_KEPT = 8192
RULE = (
    f"must be a non-empty string of at most {MAX_SESSION_ID_LEN} characters, "
    "not only whitespace, without control characters (NUL, newline, tab, ...), "
    "line separators, bidirectional controls or unpaired surrogates"
)

#: Refused character categories (Unicode general category -> what the client is told).
_REFUSED_CATEGORIES = {
    "Cc": "control character",
    "Cs": "unpaired surrogate",
    "Zl": "line separator",
    "Zp": "paragraph separator",
}
#: Format characters (``Cf``) that reorder how a log line reads: Unicode's
#: Bidi_Control set (marks, embeddings, overrides, isolates).
_BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e"
                           "\u2066\u2067\u2068\u2069")


def _refused_char(sid: str) -> Optional[str]:
    """``"<what> <char>"`` for the first refused character of ``sid``."""
    category = unicodedata.category
    for c in sid:
        what = _REFUSED_CATEGORIES.get(category(c))
        if what is None and c in _BIDI_CONTROLS:
            what = "bidirectional control character"
        if what is not None:
            return f"{what} {c!r}"
    return None


def _shown(text: str) -> str:
    text = repr(text)
    return text if len(text) <= 60 else text[:57] + "..."


def session_id_problem(session_id: Any, field: str = "session_id") -> Optional[str]:
    """Why ``session_id`` breaks the rule, or ``None`` when it is fine."""
    if not isinstance(session_id, str):
        # Only the type name: repr() of an arbitrary object may raise.
        return f"Invalid {field}: {field} {RULE}; got {type(session_id).__name__}."
    sid = str.__str__(session_id)  # exact str: a subclass may override strip/len
    if not sid.strip():
        why = f"got {'an empty string' if not sid else 'only whitespace'}"
    elif len(sid) > MAX_SESSION_ID_LEN:
        why = f"got {len(sid)} characters"
    else:
        bad = _refused_char(sid)
        if bad is None:
            return None
        why = f"got {bad} in {_shown(sid)}"
    return f"Invalid {field}: {field} {RULE}; {why}."


def validate_session_id(session_id: Any, field: str = "session_id") -> str:
    """``session_id`` as an exact ``str``, or ``ValueError`` with the rule and the reason."""
    problem = session_id_problem(session_id, field)
    if problem is not None:
        raise ValueError(problem)
    return str.__str__(session_id)


def _session_params_ids(params: Any):
    # session_params is a dict (or a list of dicts for a batch); only an
    # explicit "id" is a session id (None means "no session").
    items = params if isinstance(params, list) else [params]
    for item in items:
        if isinstance(item, dict) and item.get("id") is not None:
            yield item["id"]


def generate_request_problem(obj: Any) -> Optional[str]:
    """The first bad session id of a ``GenerateReqInput`` (top-level
    ``session_id`` and ``session_params.id``), or ``None``."""
    sid = getattr(obj, "session_id", None)
    if sid is not None:  # one id for the whole (batch) request
        problem = session_id_problem(sid, "session_id")
        if problem:
            return problem
    for one in _session_params_ids(getattr(obj, "session_params", None)):
        problem = session_id_problem(one, "session_params.id")
        if problem:
            return problem
    return None


__all__ = [
    "ENDED_IDS_KEPT",
    "MAX_SESSION_ID_LEN",
    "RULE",
    "generate_request_problem",
    "session_id_problem",
    "validate_session_id",
]
