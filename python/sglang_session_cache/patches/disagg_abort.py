"""PD disaggregation: a failed prefill transfer or bootstrap registers no
session reference.

SGLang's failure handlers release the request's KV (``release_kv_cache`` ->
``cache_finished_req``) *before* they mark it aborted, so the finish hook sees
an ordinary finished request.  The wrappers mark the request first; the
tracker's registration check refuses marked requests (the KV is still cached
as ordinary LRU data, exactly as SGLang leaves it).
"""

from __future__ import annotations

from sglang_session_cache.patches._wrap import wrap_method


def _wrap_failure(orig):
    def handler(self, req, *args, **kwargs):
        if not self.server_args.enable_session_radix_cache:
            return orig(self, req, *args, **kwargs)
        from sglang_session_cache.patches.server_wiring import _request_left
        from sglang_session_cache.session_tracker import REQ_ABORTING_ATTR

        setattr(req, REQ_ABORTING_ATTR, True)
        out = orig(self, req, *args, **kwargs)
        # A bootstrap that failed before any KV was allocated never reaches
        # cache_finished_req: the request ends here all the same, so it stops
        # keeping its session busy (a no-op when the release already did).
        _request_left(self, req)
        return out

    return handler


def apply_prefill(module) -> None:
    cls = module.SchedulerDisaggregationPrefillMixin
    for name in ("handle_inflight_transfer_failure", "handle_bootstrap_failure"):
        wrap_method(cls, name, _wrap_failure)
