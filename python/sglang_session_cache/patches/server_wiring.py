"""Scheduler, server-args and cache-selection wiring for session references.

These patches only matter with ``--enable-session-radix-cache``; with the flag
off each wrapper is a single attribute check in front of SGLang's own code.
"""

from __future__ import annotations

import logging

from sglang_session_cache.patches._wrap import wrap_class_method, wrap_method

# Log through the loggers of the modules we hook, so SGLang's logging config
# (levels, rank prefixes) applies unchanged.
_sched_logger = logging.getLogger("sglang.srt.managers.scheduler")
_registry_logger = logging.getLogger("sglang.srt.mem_cache.registry")

TTL_NO_EFFECT_WARNING = (
    "--session-radix-cache-ttl has no effect without --enable-session-radix-cache."
)


def _session_error_type():
    from sglang_session_cache.session_tracker import SessionRefError
    from sglang_session_cache.session_ttl import SessionTTLError

    return (SessionRefError, SessionTTLError)


# ---- server_args ------------------------------------------------------------


def _wrap_cache_compat(orig):
    # 0.5.16 demanded --radix-eviction-policy priority for the old RadixCache
    # mixin.  The unified tree orders eviction by session references under any
    # policy, so the check is lifted; every other compatibility rule still runs.
    # It also fails fast when the flag would have no effect (no unified tree).
    def _handle_cache_compatibility(self):
        flag = self.enable_session_radix_cache
        self.enable_session_radix_cache = False
        try:
            result = orig(self)
        finally:
            self.enable_session_radix_cache = flag
        if flag:
            from sglang_session_cache.unified_tree_requirement import startup_problem

            problem = startup_problem(self)
            if problem is not None:
                raise ValueError(problem)
        return result

    return _handle_cache_compatibility


SESSION_FLAG_HELP = (
    "Session-aware KV eviction on the unified radix tree (set "
    "SGLANG_ENABLE_UNIFIED_RADIX_TREE=1; hybrid SWA/Mamba models use it anyway): "
    "KV of open sessions is evicted only after unreferenced KV; /close_session "
    "drops that protection and the KV stays reusable. Works with any "
    "--radix-eviction-policy. (sglang-session-cache)"
)
_HELP_MARK = "__sglang_session_cache_session_flag_help__"


def _wrap_add_cli_args_help(orig):
    # Stock's text describes the old mixin ("bulk-evicted on close. Requires
    # --radix-eviction-policy priority"), neither of which holds here.
    def add_cli_args(parser):
        orig(parser)
        for action in parser._actions:
            if action.dest == "enable_session_radix_cache":
                action.help = SESSION_FLAG_HELP

    return add_cli_args


def apply_server_args(module) -> None:
    wrap_method(module.ServerArgs, "_handle_cache_compatibility", _wrap_cache_compat)


def apply_server_args_help(module) -> None:
    wrap_class_method(module.ServerArgs, "add_cli_args", _wrap_add_cli_args_help, _HELP_MARK)


def apply_server_args_ttl(module) -> None:
    """``--session-radix-cache-ttl SECONDS`` on the CLI, ``session_radix_cache_ttl``
    as a ``ServerArgs(...)`` / ``sglang.Engine(...)`` keyword; stored as an
    instance attribute (class default ``None``), so it travels to the
    scheduler processes with the pickled ``ServerArgs``."""
    from sglang_session_cache.session_ttl import patch_server_args_class

    patch_server_args_class(module.ServerArgs)


def apply_server_args_protection(module) -> None:
    """``--session-radix-cache-max-protected-fraction`` and
    ``--session-radix-cache-protect-from-turn`` (and their keywords)."""
    from sglang_session_cache.protection_options import patch_server_args_class

    patch_server_args_class(module.ServerArgs)


# ---- cache selection guard ---------------------------------------------------


def _wrap_create_tree_cache(orig):
    def create_tree_cache(ctx):
        from sglang_session_cache.unified_tree_requirement import built_cache_problem

        cache = orig(ctx)
        server_args = getattr(ctx, "server_args", None)  # getattr(None, ...) is safe
        enabled = bool(getattr(server_args, "enable_session_radix_cache", False))
        problem = built_cache_problem(server_args, cache)
        if problem is not None:
            # Scheduler start-up, not its loop: the launch fails with this message
            # instead of running with a flag that silently does nothing.
            raise ValueError(problem)
        if not enabled and getattr(server_args, "session_radix_cache_ttl", None) is not None:
            _registry_logger.warning(TTL_NO_EFFECT_WARNING)
        return cache

    return create_tree_cache


def apply_registry(module) -> None:
    # Wrapped on the module, so importers that bind the name afterwards
    # (kv_cache_builder's from-import) get the guarded version.
    wrap_method(module, "create_tree_cache", _wrap_create_tree_cache)


# ---- legacy RadixCache ----------------------------------------------------------


def _wrap_radix_init(orig):
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        # Only UnifiedRadixCache owns sessions now: the old tagging mixin on
        # RadixCache must not run (nor bulk-free nodes on close).
        self.enable_session_radix_cache = False

    return __init__


def _legacy_release_radix_session(self, session_id):
    return 0


def apply_legacy_radix_cache(module) -> None:
    from sglang_session_cache.patches._wrap import add_method

    cls = module.RadixCache
    wrap_method(cls, "__init__", _wrap_radix_init)
    add_method(cls, "release_radix_session", _legacy_release_radix_session)


# ---- scheduler -----------------------------------------------------------------


def _session_error(e: Exception) -> str:
    # Our own errors carry a log-safe text; anything else only its type (the
    # str() of an exception about a hostile id may itself raise).
    if isinstance(e, _session_error_type()):
        return str(e)
    return f"invalid session id ({type(e).__name__})"


def _plain_or_none(session_id):
    """The plain-str copy of an id, ``None`` for anything that is not a str:
    stock code hashes and compares ids, and a hostile ``str`` subclass or
    object (Engine API) would raise in there."""
    from sglang_session_cache.session_tracker import plain_session_id

    try:
        return plain_session_id(session_id)
    except Exception:  # noqa: BLE001 - e.g. a __class__ property that raises
        return None


def _wrap_open_session(orig):
    def open_session(self, recv_req):
        # An open of an id that is still explicitly open is refused (SGLang's
        # controller answers "already exist") and must not start a new
        # generation.  Decided from the tracker, not from the controller or
        # the reply: only rank 0 gets a reply, and the controller's reaper
        # drops timed-out and deferred-close sessions on each rank's own
        # clock, so asking it could re-open on some TP/PP ranks only.
        tracker = None
        if self.server_args.enable_session_radix_cache:
            sid = recv_req.session_id
            plain = _plain_or_none(sid)
            if sid is not None and plain is None:
                _sched_logger.warning("open_session rejected: session_id must be a string")
            # None makes stock open answer "cannot open" (success=False).
            recv_req.session_id = plain
            tracker = getattr(self.tree_cache, "session_ref_tracker", None)
        output = orig(self, recv_req)
        if tracker is not None and recv_req.session_id is not None:
            try:
                if not tracker.is_explicitly_open(recv_req.session_id):
                    self.tree_cache.open_radix_session(
                        recv_req.session_id,
                        streaming=bool(recv_req.streaming),
                        timeout=getattr(recv_req, "timeout", None),
                    )
            except Exception as e:  # noqa: BLE001 - never into the scheduler loop
                _sched_logger.warning("open_session rejected: %s", _session_error(e))
        return output

    return open_session


def _wrap_close_session(orig):
    def close_session(self, recv_req):
        if not self.server_args.enable_session_radix_cache:
            return orig(self, recv_req)
        from sglang_session_cache.session_tracker import check_session_id

        try:
            # Stock close hashes and compares the id: a hostile str subclass
            # would raise in there, so it gets the plain-str copy.
            recv_req.session_id = check_session_id(_plain_or_none(recv_req.session_id))
            return orig(self, recv_req)
        except Exception as e:  # noqa: BLE001 - never into the scheduler loop
            # Bad id: nothing was released; tell the operator, keep serving.
            _sched_logger.warning("close_session rejected: %s", _session_error(e))
            return None

    return close_session


def _wrap_add_request(orig):
    def _add_request_to_queue(self, req, is_retracted=False):
        # Top-level session_id, or a classic /open_session session (req.session).
        if (
            getattr(req, "session_id", None) is not None
            or getattr(req, "session", None) is not None
        ) and self.server_args.enable_session_radix_cache:
            ensure = getattr(self.tree_cache, "ensure_session_generation", None)
            if ensure is not None:
                try:
                    # From here on every reader (ours and SGLang's) sees a
                    # plain str; a non-string id is refused below.
                    plain = _plain_or_none(req.session_id)
                    if plain is not None:
                        req.session_id = plain
                    ensure(req)
                except Exception as e:  # noqa: BLE001 - never into the scheduler loop
                    req.set_finish_with_abort(f"Invalid request: {_session_error(e)}")
            out = orig(self, req, is_retracted=is_retracted)
            # Refused before queueing (priority check, queue limit): it ends
            # here, so it must not keep its session busy.  O(1): an admitted
            # request is the last one queued.
            if getattr(self, "disaggregation_mode", None) == _null_mode():
                queue = self.waiting_queue
                if not queue or queue[-1] is not req:
                    _request_left(self, req)
            return out
        return orig(self, req, is_retracted=is_retracted)

    return _add_request_to_queue


def _null_mode():
    from sglang.srt.disaggregation.utils import DisaggregationMode

    return DisaggregationMode.NULL


def _request_left(sched, req) -> None:
    tracker = getattr(sched.tree_cache, "session_ref_tracker", None)
    if tracker is not None:
        from sglang_session_cache.patches.unified_cache import guarded

        guarded(tracker.request_finished, req)


def _left_queue(sched, before) -> None:
    """Requests of ``before`` no longer in the waiting queue left it without
    a finish: they stop keeping their session busy."""
    kept = {id(r) for r in sched.waiting_queue}
    for req in before:
        if id(req) not in kept:
            _request_left(sched, req)


def _queued_left(sched, orig, *args):
    """Run ``orig``; requests it took out of the waiting queue without a
    finish (aborted before they started) stop keeping their session busy."""
    before = list(sched.waiting_queue)
    out = orig(sched, *args)
    _left_queue(sched, before)
    return out


def _wrap_abort_request(orig):
    def abort_request(self, recv_req):
        if not self.server_args.enable_session_radix_cache or not self.waiting_queue:
            return orig(self, recv_req)
        return _queued_left(self, orig, recv_req)

    return abort_request


def _wrap_abort_on_queued_limit(orig):
    def _abort_on_queued_limit(self, recv_req):
        if (
            not self.server_args.enable_session_radix_cache
            or self.max_queued_requests is None
            or len(self.waiting_queue) + 1 <= self.max_queued_requests
        ):
            return orig(self, recv_req)
        # Queue full (rare): a queued request may be preempted.
        return _queued_left(self, orig, recv_req)

    return _abort_on_queued_limit


def _wrap_abort_on_waiting_timeout(orig):
    def _abort_on_waiting_timeout(self):
        # Runs every scheduler iteration: O(1) unless SGLang dropped timed-out
        # requests (SGLANG_REQ_WAITING_TIMEOUT), which it does by replacing
        # the queue list; those never finish, so they leave here.
        before = self.waiting_queue
        out = orig(self)
        if self.waiting_queue is not before and self.server_args.enable_session_radix_cache:
            _left_queue(self, before)
        return out

    return _abort_on_waiting_timeout


def _wrap_handle_generate_request(orig):
    def handle_generate_request(self, recv_req):
        # SGLang's controller restarts a session's own timeout when it creates
        # a request of it, here (a request waiting for its grammar is queued
        # later); the tracker's mirror of that timeout restarts with it.
        params = getattr(recv_req, "session_params", None)
        if (params is not None and getattr(recv_req, "session_id", None) is None
                and self.server_args.enable_session_radix_cache):
            tracker = getattr(self.tree_cache, "session_ref_tracker", None)
            try:
                sid = _plain_or_none(getattr(params, "id", None))
                session = self.session_controller.get(sid) if sid is not None else None
                if tracker is not None and session is not None and not session.close_on_finish:
                    tracker.controller_request(sid)
            except Exception as e:  # noqa: BLE001 - never into the scheduler loop
                _sched_logger.warning("session timeout not restarted: %s", _session_error(e))
        return orig(self, recv_req)

    return handle_generate_request


def apply_scheduler(module) -> None:
    cls = module.Scheduler
    wrap_method(cls, "open_session", _wrap_open_session)
    wrap_method(cls, "close_session", _wrap_close_session)
    wrap_method(cls, "_add_request_to_queue", _wrap_add_request)
    wrap_method(cls, "abort_request", _wrap_abort_request)
    wrap_method(cls, "_abort_on_queued_limit", _wrap_abort_on_queued_limit)
    wrap_method(cls, "_abort_on_waiting_timeout", _wrap_abort_on_waiting_timeout)
    wrap_method(cls, "handle_generate_request", _wrap_handle_generate_request)


# ---- scheduler stats: session metrics in the log line and Prometheus -----------

_metrics_logger = logging.getLogger(
    "sglang.srt.managers.scheduler_components.metrics_reporter"
)
_metrics_failed = []


def _metrics_guard(what: str, fn, *args):
    # Metrics must never take the scheduler down: log the first failure only.
    try:
        return fn(*args)
    except Exception:
        if not _metrics_failed:
            _metrics_failed.append(what)
            _metrics_logger.exception("session radix cache metrics (%s) failed", what)
        return None


def _wrap_get_pool_stats(orig):
    def get_pool_stats(self):
        stats = orig(self)
        cache = self.tree_cache
        if getattr(cache, "session_ref_tracker", None) is not None:
            stats._session_cache = cache  # read lazily, only when logged/published
        return stats

    return get_pool_stats


def _wrap_usage_msg_parts(orig):
    def usage_msg_parts(self):
        parts = orig(self)
        cache = self._session_cache
        if cache is not None:
            from sglang_session_cache.session_metrics import log_part

            fragment = _metrics_guard("log line", log_part, cache)
            if fragment:
                parts.append(fragment)
        return parts

    return usage_msg_parts


def _wrap_update_scheduler_stats(orig):
    def update_scheduler_stats(self, stats):
        orig(self, stats)
        cache = self._session_cache
        if cache is not None:
            from sglang_session_cache.session_metrics import publish

            _metrics_guard("prometheus", publish, cache)

    return update_scheduler_stats


def apply_pool_stats(module) -> None:
    if "_session_cache" not in module.PoolStats.__dict__:
        module.PoolStats._session_cache = None
    wrap_method(module.SchedulerPoolStatsObserver, "get_pool_stats", _wrap_get_pool_stats)
    for name in ("get_prefill_usage_msg_parts", "get_decode_usage_msg_parts"):
        wrap_method(module.PoolStats, name, _wrap_usage_msg_parts)
    wrap_method(module.PoolStats, "update_scheduler_stats", _wrap_update_scheduler_stats)
