"""Test-only stand-in for ``vllm._custom_ops``.

sglang 0.5.16's rotary embedding imports ``rotary_embedding`` from here on a
CPU-only machine without calling it. Only that name exists, so optional imports
of other kernels (e.g. ``layernorm``'s ``rms_norm``) still fail and SGLang uses
its native torch fallbacks.
"""


def rotary_embedding(*args, **kwargs):
    raise NotImplementedError(
        "test stand-in for vllm._custom_ops.rotary_embedding was called; "
        "the CPU path is expected to use the native torch implementation"
    )
