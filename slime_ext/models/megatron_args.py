"""Megatron-LM's model arguments (slime's scripts/models/qwen3-*.sh MODEL_ARGS) read from a
Qwen3 HF checkpoint's config.json: what the rehearsal's tiny student and the tests' jobs
source as their model_args_script."""

from __future__ import annotations

import json
from pathlib import Path


def qwen3_model_args(hf_dir: Path) -> list[str]:
    """MODEL_ARGS of a Qwen3 HF checkpoint (dense; its config.json)."""
    config = json.loads((hf_dir / "config.json").read_text())
    rope = config.get("rope_parameters") or {}
    args = [
        "--swiglu",
        "--num-layers", str(config["num_hidden_layers"]),
        "--hidden-size", str(config["hidden_size"]),
        "--ffn-hidden-size", str(config["intermediate_size"]),
        "--num-attention-heads", str(config["num_attention_heads"]),
        "--group-query-attention",
        "--num-query-groups", str(config["num_key_value_heads"]),
        "--use-rotary-position-embeddings",
        "--disable-bias-linear",
        "--normalization", "RMSNorm",
        "--norm-epsilon", str(config["rms_norm_eps"]),
        "--rotary-base", str(int(rope.get("rope_theta", config.get("rope_theta", 10000)))),
        "--vocab-size", str(config["vocab_size"]),
        "--kv-channels", str(config["head_dim"]),
        "--qk-layernorm",
    ]  # fmt: skip
    if not config.get("tie_word_embeddings", False):
        args.append("--untie-embeddings-and-output-weights")
    return args
