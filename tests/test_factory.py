from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout.harness.tir import PYTHON_TOOL
from slime_ext.models.factory import (
    MARKUP_TOKENS,
    PRESETS,
    SPECIAL_TOKENS,
    UnknownPresetError,
    build_model,
    build_tokenizer,
    materialize,
)

TOOLS = [PYTHON_TOOL]  # the TIR harness's python tool
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Solve with tools."},
    {"role": "user", "content": "What is 12 * 7?"},
    {
        "role": "assistant",
        "reasoning_content": "Multiply with python.",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "python", "arguments": {"code": "print(12 * 7)"}},
            }
        ],
    },
    {"role": "tool", "content": "84"},
    {
        "role": "assistant",
        "reasoning_content": "The tool says 84.",
        "content": "The answer is \\boxed{84}.",
    },
]


def _render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, **kwargs)


def test_tokenizer_is_deterministic(factory_tokenizer: Any) -> None:
    assert build_tokenizer().get_vocab() == factory_tokenizer.get_vocab()


@pytest.mark.parametrize(
    "text",
    [
        "print(12 * 7)\n",
        "  indented\tcode\n\n",
        "naïve café ∑ 数学 🙂",
        "x=-3.5e10",
        "",
    ],
)
def test_tokenizer_round_trips_any_text(factory_tokenizer: Any, text: str) -> None:
    ids = factory_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert factory_tokenizer.decode(ids) == text


def test_control_and_markup_tokens_are_single_ids(factory_tokenizer: Any) -> None:
    for token in (*SPECIAL_TOKENS, *MARKUP_TOKENS):
        ids = factory_tokenizer(token, add_special_tokens=False)["input_ids"]
        assert ids == [factory_tokenizer.convert_tokens_to_ids(token)], token
    assert factory_tokenizer.eos_token == "<|im_end|>"
    assert factory_tokenizer.pad_token == "<|endoftext|>"
    # markup survives skip_special_tokens, control tokens do not (as in Qwen3)
    ids = factory_tokenizer("<|im_start|><think>x</think><|im_end|>")["input_ids"]
    assert factory_tokenizer.decode(ids, skip_special_tokens=True) == "<think>x</think>"


def test_digits_are_split_one_by_one(factory_tokenizer: Any) -> None:
    tokens = factory_tokenizer.tokenize("12345")
    assert [factory_tokenizer.convert_tokens_to_string([t]) for t in tokens] == list("12345")


def test_template_renders_tool_conversation(factory_tokenizer: Any) -> None:
    text = _render(factory_tokenizer, CONVERSATION)
    assert text.startswith("<|im_start|>system\nSolve with tools.\n\n# Tools")
    assert '"name": "python"' in text.split("\n</tools>")[0]
    assert (
        "<|im_start|>assistant\n<think>\nMultiply with python.\n</think>\n\n<tool_call>\n"
        '{"name": "python", "arguments": {"code": "print(12 * 7)"}}\n</tool_call><|im_end|>\n'
        in text
    )
    assert "<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n" in text
    assert text.endswith("The answer is \\boxed{84}.<|im_end|>\n")


def test_template_keeps_think_inside_the_tool_episode(factory_tokenizer: Any) -> None:
    text = _render(factory_tokenizer, CONVERSATION)
    assert "Multiply with python." in text and "The tool says 84." in text


def test_template_drops_think_before_a_later_user_message(factory_tokenizer: Any) -> None:
    follow_up = [*CONVERSATION, {"role": "user", "content": "And 13 * 7?"}]
    text = _render(factory_tokenizer, follow_up, add_generation_prompt=True)
    assert "Multiply with python." not in text and "The tool says 84." not in text
    assert "<think>" not in text
    kept = _render(factory_tokenizer, follow_up, preserve_thinking=True)
    assert "Multiply with python." in kept and "The tool says 84." in kept


def test_template_without_think_renders_no_empty_think(factory_tokenizer: Any) -> None:
    plain = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in CONVERSATION]
    text = _render(factory_tokenizer, plain)
    assert "<think>" not in text
    assert "<|im_start|>assistant\n<tool_call>\n" in text


def test_think_inside_content_is_split_like_reasoning(factory_tokenizer: Any) -> None:
    inline = [
        CONVERSATION[1],
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nok"},
        {"role": "user", "content": "again"},
    ]
    text = factory_tokenizer.apply_chat_template(inline, tokenize=False)
    assert "<|im_start|>assistant\nok<|im_end|>" in text and "hmm" not in text


def test_generation_prompt_and_thinking_switch(factory_tokenizer: Any) -> None:
    prompt = CONVERSATION[:2]
    assert _render(factory_tokenizer, prompt, add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n"
    )
    assert _render(
        factory_tokenizer, prompt, add_generation_prompt=True, enable_thinking=False
    ).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_tokenized_template_equals_tokenizing_the_text(factory_tokenizer: Any) -> None:
    encoded = factory_tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=True)
    text = _render(factory_tokenizer, CONVERSATION)
    assert (
        list(encoded["input_ids"]) == factory_tokenizer(text, add_special_tokens=False)["input_ids"]
    )


def test_consecutive_tool_messages_share_one_user_turn(factory_tokenizer: Any) -> None:
    messages = [
        *CONVERSATION[:3],
        {"role": "tool", "content": "84"},
        {"role": "tool", "content": "85"},
    ]
    text = _render(factory_tokenizer, messages)
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\n84\n</tool_response>\n"
        "<tool_response>\n85\n</tool_response><|im_end|>\n"
    )


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_models_run_forward_and_backward(factory_tokenizer: Any, preset: str) -> None:
    model = build_model(preset, factory_tokenizer, seed=0)
    ids = torch.tensor(
        [
            factory_tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=True)[
                "input_ids"
            ]
        ]
    )
    output = model(input_ids=ids, labels=ids)
    assert output.logits.shape == (1, ids.shape[1], len(factory_tokenizer))
    assert torch.isfinite(output.loss)
    output.loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads if g is not None) > 0


def test_hybrid_preset_has_linear_attention_layers(factory_tokenizer: Any) -> None:
    model = build_model("qwen3_5-tiny", factory_tokenizer)
    assert model.config.layer_types.count("linear_attention") == 2
    assert model.config.layer_types.count("full_attention") == 2


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_models_are_deterministic_by_seed(factory_tokenizer: Any, preset: str) -> None:
    first = build_model(preset, factory_tokenizer, seed=3).state_dict()
    again = build_model(preset, factory_tokenizer, seed=3).state_dict()
    other = build_model(preset, factory_tokenizer, seed=4).state_dict()
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert any(not torch.equal(first[name], other[name]) for name in first)


def test_building_leaves_global_rng_alone(factory_tokenizer: Any) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model("qwen3-tiny", factory_tokenizer, seed=9)
    assert torch.equal(torch.rand(3), expected)


def test_saved_checkpoint_loads_by_path(factory_dir: Path, factory_tokenizer: Any) -> None:
    tokenizer = AutoTokenizer.from_pretrained(factory_dir)
    assert tokenizer.get_vocab() == factory_tokenizer.get_vocab()
    assert _render(tokenizer, CONVERSATION) == _render(factory_tokenizer, CONVERSATION)
    loaded = AutoModelForCausalLM.from_pretrained(factory_dir)
    rebuilt = build_model("qwen3-tiny", factory_tokenizer, seed=0)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.allclose(loaded(input_ids=ids).logits, rebuilt(input_ids=ids).logits)


def test_materialize_builds_once_and_accepts_paths(tmp_path: Path) -> None:
    built = materialize("factory:qwen3-tiny", tmp_path)
    stamp = (built / "config.json").stat().st_mtime_ns
    assert materialize("factory:qwen3-tiny", tmp_path) == built
    assert (built / "config.json").stat().st_mtime_ns == stamp
    assert materialize(str(built), tmp_path / "unused") == built


def test_materialize_errors_name_the_choices(tmp_path: Path) -> None:
    with pytest.raises(UnknownPresetError, match="presets: qwen3-small, qwen3-tiny"):
        materialize("factory:gpt-huge", tmp_path)
    with pytest.raises(FileNotFoundError, match="hub downloads are not used"):
        materialize("Qwen/Qwen3-8B", tmp_path)
