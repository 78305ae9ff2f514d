"""pytest setup for the mem_cache unit tests. Kept small and import-cheap on
purpose; cache fixtures live in cache_fixtures.py.

The tests exercise the *installed* package (its .pth autoload included), so
they must run in a venv where ``pip install .`` has been done -- which is what
``bash scripts/test.sh`` does.
"""

import pytest


def pytest_configure(config):
    try:
        import sglang_session_cache  # noqa: F401
    except ImportError as exc:
        raise pytest.UsageError(
            f"sglang_session_cache is not installed in this interpreter ({exc}); "
            "run the tests with `bash scripts/test.sh`"
        ) from exc
