"""Test-side name for the real-cache CPU harness.

The harness lives in the benchmark package (``sglang_session_cache_bench.harness``),
outside the runtime package, because the benchmarks drive the same real
``UnifiedRadixCache`` through it.
"""

from sglang_session_cache_bench.harness import *  # noqa: F401,F403
from sglang_session_cache_bench.harness import __all__  # noqa: F401
