"""Start-up hook, imported by ``sglang_session_cache.pth`` in every interpreter.

The ``.pth`` file sits at the root of site-packages, so ``site`` runs its single
``import`` line at start-up in every process of the environment, including
``multiprocessing`` spawn children. All this module does is put the import hook
on ``sys.meta_path``; nothing is patched until SGLang imports a patched module.

Set ``SGLANG_SESSION_CACHE_DISABLE=1`` to turn the patch set off (this hook
and the SGLang plugin). ``SGLANG_SESSION_CACHE_AUTOLOAD=0`` turns off only this
hook, leaving activation to SGLang's plugin loader (enough for servers, see
README). The hook also stays off when ``SGLANG_PLUGINS`` is set without
``sglang_session_cache``, so SGLang's plugin filter covers both paths.

Keep this module cheap: stdlib only, no sglang, no torch.
"""

import os
import sys

DISABLE_ENV = "SGLANG_SESSION_CACHE_DISABLE"
AUTOLOAD_ENV = "SGLANG_SESSION_CACHE_AUTOLOAD"
_FALSE = ("0", "false", "no", "off")


def autoload_disabled() -> bool:
    """``SGLANG_SESSION_CACHE_DISABLE`` is set: no hook, no plugin."""
    value = os.environ.get(DISABLE_ENV, "").strip().lower()
    return value not in ("", *_FALSE)


def pth_hook_wanted() -> bool:
    """Whether this start-up hook should install the import finder."""
    if autoload_disabled():
        return False
    if os.environ.get(AUTOLOAD_ENV, "").strip().lower() in _FALSE:
        return False
    from sglang_session_cache.plugin import selected_by_sglang_plugins

    return selected_by_sglang_plugins()


def _autoload() -> None:
    if not pth_hook_wanted():
        return
    try:
        from sglang_session_cache.activation import install_hook

        install_hook()
    except Exception as exc:  # never break interpreter start-up
        sys.stderr.write(
            f"sglang-session-cache: autoload failed ({type(exc).__name__}: {exc}); "
            "SGLang will run unpatched.\n"
        )


_autoload()
