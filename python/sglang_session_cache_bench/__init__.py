"""Benchmarks and the real-cache CPU harness for sglang-session-cache.

Kept outside the runtime package ``sglang_session_cache`` on purpose: a server
never imports anything from here.
"""
