"""Tiny local models for running a real SGLang server on CPU.

No model hub is reachable in CI, so the models are built here: random weights
written with transformers' ``save_pretrained`` and a small BPE tokenizer
trained with ``tokenizers`` on a generated corpus. They produce nonsense, which
is all the cache tests need: the prefix cache sees real tokens, real KV and
real batching.

Kinds:

``llama``
    ``LlamaForCausalLM``, full attention only -> a FULL-only unified tree.
``mellum``
    ``MellumForCausalLM`` with ``layer_types`` alternating sliding and full
    attention and dense MLPs -> a real FULL+SWA unified tree (the hybrid-SWA
    architecture that runs on CPU in sglang 0.5.16).

Each model is cached on disk under ``<root>/<kind>-<hash>`` where the hash
covers the config, the tokenizer recipe and the library versions, so a change
rebuilds it and concurrent builders never see a half-written directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Optional

#: Vocabulary of the trained tokenizer (and the models' embedding size).
VOCAB_SIZE = 512
#: Sliding window of the Mellum model's SWA layers, in tokens.
MELLUM_SLIDING_WINDOW = 32
MAX_POSITIONS = 8192
RECIPE_VERSION = 1  # bump to rebuild every cached model

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=MAX_POSITIONS,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

MODEL_CONFIGS = {
    "llama": dict(_COMMON, num_hidden_layers=2),
    "mellum": dict(
        _COMMON,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        mlp_layer_types=["dense"] * 4,
        sliding_window=MELLUM_SLIDING_WINDOW,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
}
KINDS = tuple(MODEL_CONFIGS)

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]


def default_model_root() -> Path:
    base = os.environ.get("SGLANG_SESSION_CACHE_MODEL_DIR")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / (
        "sglang_session_cache" + "/tiny_models"
    )


def _fingerprint(kind: str) -> str:
    import tokenizers
    import transformers

    blob = json.dumps(
        {
            "kind": kind,
            "config": MODEL_CONFIGS[kind],
            "recipe": RECIPE_VERSION,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _corpus(n_lines: int = 4000, seed: int = 0):
    rng = random.Random(seed)
    syll = ["ka", "lo", "mi", "ne", "su", "ra", "to", "vi", "de", "po", "an", "el"]
    words = ["".join(rng.choice(syll) for _ in range(rng.randint(1, 4))) for _ in range(600)]
    words += ["def", "return", "import", "class", "tool", "user", "assistant", "error"]
    for _ in range(n_lines):
        yield " ".join(rng.choice(words) for _ in range(rng.randint(4, 20)))


def _build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=MAX_POSITIONS,
    )
    fast.save_pretrained(out)


def _build_weights(kind: str, out: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = dict(MODEL_CONFIGS[kind])
    if kind == "llama":
        config = transformers.LlamaConfig(**cfg)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.MellumConfig(**cfg)
        model = transformers.MellumForCausalLM(config)
    model.to(torch.float32).save_pretrained(out)


def build_tiny_model(kind: str, root: Optional[os.PathLike] = None) -> Path:
    """Return the directory of the tiny ``kind`` model, building it if needed."""
    if kind not in MODEL_CONFIGS:
        raise ValueError(f"unknown tiny model kind {kind!r}; choose from {KINDS}")
    root = Path(root) if root is not None else default_model_root()
    final = root / f"{kind}-{_fingerprint(kind)}"
    if (final / "config.json").is_file() and (final / "tokenizer.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=root))
    try:
        _build_tokenizer(tmp)
        _build_weights(kind, tmp)
        try:
            os.rename(tmp, final)  # atomic; loses the race harmlessly
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


__all__ = ["KINDS", "MODEL_CONFIGS", "VOCAB_SIZE", "build_tiny_model", "default_model_root"]
