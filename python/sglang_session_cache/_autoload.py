"""Start-up hook, imported by ``sglang_session_cache.pth`` in every interpreter.

The ``.pth`` file sits at the root of site-packages, so ``site`` runs its single
``import`` line at start-up in every process of the environment, including
``multiprocessing`` spawn children. All this module does is put the import hook
on ``sys.meta_path``; nothing is patched until SGLang imports a patched module.

Set ``SGLANG_SESSION_CACHE_DISABLE=1`` to turn the autoload off.

Keep this module cheap: stdlib only, no sglang, no torch.
"""

import os
import sys

DISABLE_ENV = "SGLANG_SESSION_CACHE_DISABLE"


def autoload_disabled() -> bool:
    value = os.environ.get(DISABLE_ENV, "").strip().lower()
    return value not in ("", "0", "false", "no", "off")


def _autoload() -> None:
    if autoload_disabled():
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
