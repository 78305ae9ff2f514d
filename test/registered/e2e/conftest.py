"""pytest setup for the live-server E2E tests (real ``sglang.launch_server``
processes on CPU, tiny local models)."""

import pytest


def pytest_configure(config):
    try:
        import sglang_session_cache  # noqa: F401
    except ImportError as exc:
        raise pytest.UsageError(
            f"sglang_session_cache is not installed in this interpreter ({exc}); "
            "run the tests with `bash scripts/test.sh`"
        ) from exc
