"""Test-only stand-in for the ``vllm`` package (see test/stand_ins/README.md)."""
