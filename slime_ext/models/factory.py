"""Small models for tests, benchmarks and the demo, built here (no hub downloads).

- `build_tokenizer()`: a byte-level BPE tokenizer trained with the `tokenizers` library
  on a small fixed corpus, with a Qwen3-style chat template (im_start/im_end, think
  blocks, hermes tool calls, tool responses). Deterministic.
- `build_model(preset, tokenizer, seed)`: a random-init Qwen3 (full attention) or Qwen3.5
  hybrid (linear-attention + full-attention layers) model from a transformers config,
  deterministic by seed.
- `build_checkpoint(preset, out_dir, seed)`: both, saved as a HF directory that every
  other part of the system loads by path. `factory:<preset>` names one in configs.
"""

from __future__ import annotations

import hashlib
import random
from importlib import resources
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedModel, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

FACTORY_PREFIX = "factory:"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Control tokens: skipped by decode(skip_special_tokens=True)."""
MARKUP_TOKENS = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
"""Single-id markup that stays in decoded text, as in Qwen3."""
DEFAULT_VOCAB_SIZE = 2048


class UnknownPresetError(KeyError):
    """A `factory:<preset>` name that the factory does not define."""

    def __str__(self) -> str:
        return str(self.args[0])


class ModelSpec(BaseModel):
    """The shape of a factory model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    arch: Literal["qwen3", "qwen3_5"]
    """qwen3: every layer full attention; qwen3_5: hybrid, see `layer_types`."""
    hidden_size: int = Field(ge=8)
    num_layers: int = Field(ge=1)
    num_heads: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=4)
    intermediate_size: int = Field(ge=8)
    max_position_embeddings: int = 8192
    layer_types: tuple[str, ...] | None = None
    """qwen3_5 only: 'linear_attention' or 'full_attention' per layer."""
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 2
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16


PRESETS: dict[str, ModelSpec] = {
    "qwen3-tiny": ModelSpec(
        arch="qwen3",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
    ),
    "qwen3-small": ModelSpec(
        arch="qwen3",
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=384,
    ),
    "qwen3_5-tiny": ModelSpec(
        arch="qwen3_5",
        hidden_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        layer_types=("linear_attention", "full_attention", "linear_attention", "full_attention"),
    ),
}


def chat_template() -> str:
    return resources.files(__package__).joinpath("chat_template.jinja").read_text()


CORPUS_PACKAGES = ("rollout.harness.prompts", "rollout.tasks")
"""Their YAML files (prompts, problem templates) join the corpus, so the text every
rollout repeats (system prompts, tool instructions) takes few tokens."""


def _training_corpus() -> list[str]:
    """Fixed text, the chat template's and the prompts' text, and numbers; a seeded
    generator keeps the vocabulary deterministic."""
    package = resources.files(__package__)
    lines = package.joinpath("factory_corpus.txt").read_text().splitlines()
    lines += chat_template().splitlines()
    for name in CORPUS_PACKAGES:
        for entry in sorted(resources.files(name).iterdir(), key=lambda e: e.name):
            if entry.name.endswith(".yaml"):
                lines += entry.read_text().splitlines()
    rng = random.Random(0)
    numbers = [f"{rng.randint(0, 10_000)} + {rng.randint(0, 999)} = ?" for _ in range(200)]
    return lines * 20 + numbers


def build_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (digits split one by one) with the factory chat template."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    backend.train_from_iterator(_training_corpus(), trainer=trainer)
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template(),
        model_max_length=8192,
        clean_up_tokenization_spaces=False,
    )


def get_preset(name: str) -> ModelSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise UnknownPresetError(
            f"unknown factory preset {name!r}; presets: {', '.join(sorted(PRESETS))}"
        ) from None


def build_model(
    spec: ModelSpec | str, tokenizer: PreTrainedTokenizerFast, seed: int = 0
) -> PreTrainedModel:
    """A random-init causal LM whose vocabulary is the tokenizer's; same seed, same weights."""
    spec = get_preset(spec) if isinstance(spec, str) else spec
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    # fork_rng: building a model must not move the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if spec.arch == "qwen3":
            return Qwen3ForCausalLM(Qwen3Config(**common))
        # here, not at import: Qwen3.5's modeling imports flash-linear-attention where it is
        # installed, which warns on a machine without a GPU (a Qwen3 build never needs it)
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        layer_types = list(spec.layer_types or ["linear_attention"] * spec.num_layers)
        if len(layer_types) != spec.num_layers:
            raise ValueError(
                f"layer_types has {len(layer_types)} entries for {spec.num_layers} layers"
            )
        config = Qwen3_5TextConfig(
            **common,
            layer_types=layer_types,
            linear_num_key_heads=spec.linear_num_key_heads,
            linear_num_value_heads=spec.linear_num_value_heads,
            linear_key_head_dim=spec.linear_key_head_dim,
            linear_value_head_dim=spec.linear_value_head_dim,
        )
        return Qwen3_5ForCausalLM(config)


def build_checkpoint(preset: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Save a factory tokenizer and model to `out_dir` (a normal HF directory)."""
    out = Path(out_dir)
    tokenizer = build_tokenizer()
    model = build_model(preset, tokenizer, seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    return out


def is_factory_ref(name: str) -> bool:
    return name.startswith(FACTORY_PREFIX)


def materialize(name: str, cache_dir: str | Path, seed: int = 0) -> Path:
    """A local directory for `name`: itself if a path, else the built `factory:<preset>`."""
    if not is_factory_ref(name):
        path = Path(name)
        if not path.is_dir():
            raise FileNotFoundError(
                f"model {name!r} is neither a local HF directory nor factory:<preset> "
                f"(presets: {', '.join(sorted(PRESETS))}); hub downloads are not used"
            )
        return path
    preset = name.removeprefix(FACTORY_PREFIX)
    get_preset(preset)
    # the tokenizer is trained on the packaged prompts: a cached build from other prompts
    # would tokenize differently, so the cache key carries the corpus's digest
    corpus = hashlib.sha256("\n".join(_training_corpus()).encode()).hexdigest()[:10]
    out = Path(cache_dir) / f"{preset}-seed{seed}-{corpus}"
    if not (out / "config.json").is_file():
        build_checkpoint(preset, out, seed=seed)
    return out
