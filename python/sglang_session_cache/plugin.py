"""Entry point for SGLang's own plugin loader (``sglang.srt.plugins``).

``pyproject.toml`` registers :func:`load_plugin` as the general plugin
``sglang_session_cache`` in the ``sglang.srt.plugins`` entry-point group.
SGLang 0.5.16 calls ``load_plugins()`` in the CLI entry (``launch_server``,
``sglang serve``), in ``Engine.__init__`` / ``Engine._launch_subprocesses`` and
first thing in every scheduler process (``run_scheduler_process``); it lists and
logs the plugins it finds ("Loaded plugin sglang_session_cache ..."), honours
``SGLANG_PLUGINS`` (comma-separated names to load) and then runs each one.

By then SGLang has imported most of the modules we patch (the scheduler
process unpickles ``run_scheduler_process``, which imports the scheduler and
the whole cache stack), so :func:`load_plugin` patches the already imported
modules in place (:func:`sglang_session_cache.activate`); module functions that
other modules copied with a from-import are re-pointed as well
(``patches._wrap.rebind_imported``). Modules imported later are patched by the
import hook that ``activate`` installs.

SGLang 0.5.16 logs "Loaded plugin ..." before any process has configured
logging (``load_plugins()`` precedes ``configure_logger`` in the CLI entry,
``Engine`` and the scheduler), so with the default logging that line is
dropped. The plugin therefore registers one ``HookRegistry`` AFTER hook on
``configure_logger``: the first time a process configures its logging, the
server log gets one line naming this plugin and what it applied there.

Stdlib-only at import time: SGLang imports this module for every process that
loads plugins.
"""

from __future__ import annotations

import logging
import os

PLUGIN_NAME = "sglang_session_cache"  # the entry-point name, as SGLANG_PLUGINS spells it
PLUGINS_ENV = "SGLANG_PLUGINS"

logger = logging.getLogger(__name__)

LOGGER_SETUP_TARGET = "sglang.srt.utils.common.configure_logger"
_reported = False


def selected_by_sglang_plugins() -> bool:
    """False when ``SGLANG_PLUGINS`` is set and does not name this plugin
    (parsed as SGLang's ``load_plugins_by_group`` does)."""
    allowed = os.environ.get(PLUGINS_ENV, "")
    if not allowed:
        return True
    return PLUGIN_NAME in {x.strip() for x in allowed.split(",") if x.strip()}


def load_plugin() -> None:
    """Called by SGLang's ``load_plugins()``: activate the patch set in this process."""
    from sglang_session_cache._autoload import DISABLE_ENV, autoload_disabled

    if autoload_disabled():
        logger.info("sglang-session-cache: disabled by %s; SGLang runs unpatched.", DISABLE_ENV)
        return
    from sglang_session_cache.activation import activate

    if not activate():  # the version guard logs its refusal itself
        return
    logger.info(_active_message())
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    # load_plugins() applies registered hooks right after the plugins ran.
    HookRegistry.register(LOGGER_SETUP_TARGET, _report_once, HookType.AFTER)


def _active_message() -> str:
    from sglang_session_cache import __version__
    from sglang_session_cache.activation import applied_patches

    return (
        f"sglang-session-cache {__version__} active (SGLang plugin {PLUGIN_NAME}): "
        f"{len(applied_patches())} patches applied in this process"
    )


def _report_once(result, *args, **kwargs):
    """AFTER hook on ``configure_logger``: the active line, once per process,
    now that the process's log handler exists. Never raises."""
    global _reported
    if not _reported:
        _reported = True
        try:
            logger.info(_active_message())
        except Exception:  # a log line must not break logger set-up
            pass
    return None
