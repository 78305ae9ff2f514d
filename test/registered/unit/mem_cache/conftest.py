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



@pytest.fixture(autouse=True, scope="session")
def classic_session_protection():
    """The session mechanics tests describe protection from a session's
    first request with no bound on it (``--session-radix-cache-protect-from-turn 1
    --session-radix-cache-max-protected-fraction 1``); tests of earned
    protection and of the bound (test_session_protection.py) set their own.
    Session-scoped so module-scoped fixtures see it too."""
    from sglang_session_cache_bench import harness
    from sglang_session_cache.protection_policy import FRACTION_FIELD, FROM_TURN_FIELD

    saved = harness.SESSION_SERVER_ARGS
    harness.SESSION_SERVER_ARGS = {FRACTION_FIELD: 1.0, FROM_TURN_FIELD: 1}
    yield
    harness.SESSION_SERVER_ARGS = saved
