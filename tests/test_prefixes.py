"""The local student's prefix reuse (rollout/prefixes.py): a session's next turn feeds only
what its held keys and values do not cover, and gives what re-encoding the whole context
gives (the same greedy tokens, log-probs to float rounding), alone or in a batch whose rows
reuse different amounts; a drifted context reuses up to its first change; the store stays
within its bytes; a model with linear-attention layers re-encodes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from rollout.policy import GenerationRequest, HFPolicy, SamplingParams
from rollout.prefixes import Prefix, PrefixStore
from slime_ext.models.factory import build_model

GREEDY = SamplingParams(max_new_tokens=10, temperature=0)
ATOL = 1e-4


@pytest.fixture(scope="module")
def model(factory_tokenizer: Any) -> Any:
    return build_model("qwen3-tiny", factory_tokenizer, seed=5).eval()


def _context(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(5, 1500, (length,), generator=generator)]


def _batch(policy: HFPolicy, contexts: list[list[int]], sessions: list[str | None]) -> list[Any]:
    requests = [
        GenerationRequest(ids, GREEDY, session)
        for ids, session in zip(contexts, sessions, strict=True)
    ]
    return asyncio.run(policy.generate_batch(requests))


def _same(reused: list[Any], encoded: list[Any]) -> None:
    for with_prefix, without in zip(reused, encoded, strict=True):
        assert with_prefix.output_ids == without.output_ids
        assert torch.allclose(
            torch.tensor(with_prefix.logprobs), torch.tensor(without.logprobs), atol=ATOL
        )


def test_later_turns_feed_only_their_new_tail_and_equal_a_full_encoding(model: Any) -> None:
    """Three sessions, a first turn each (different lengths, one batch), then a second
    turn whose context is the first's, its output and an observation: one session's
    observation differs early (drift: it reuses up to there), a fourth request has no
    session. The second batch equals a policy without reuse, row for row."""
    eos = model.config.eos_token_id
    reusing = HFPolicy(model, eos)
    plain = HFPolicy(model, eos, prefix_cache_bytes=0)
    first = [_context(i, 30 + 17 * i) for i in range(3)]
    sessions: list[str | None] = ["a", "b", "c"]
    turn_one = _batch(reusing, first, sessions)
    _same(turn_one, _batch(plain, first, sessions))
    assert reusing.context_tokens["reused"] == 0 and len(reusing.prefixes) == 3
    second = [
        ids + g.output_ids + _context(10 + i, 6 + 5 * i)
        for i, (ids, g) in enumerate(zip(first, turn_one, strict=True))
    ]
    second[2][4] += 1  # drifted: the context changed at token 4
    contexts = [*second, _context(99, 25)]
    sessions = [*sessions, None]
    turn_two = _batch(reusing, contexts, sessions)
    _same(turn_two, _batch(plain, contexts, sessions))
    # a and b: context + all but the last output token; c: up to its change
    held = [len(first[i]) + len(turn_one[i].output_ids) - 1 for i in range(2)]
    assert reusing.context_tokens["reused"] == sum(held) + 4
    assert plain.context_tokens["reused"] == 0


def test_a_session_alone_reuses_turn_after_turn_and_forgets_when_it_ends(model: Any) -> None:
    eos = model.config.eos_token_id
    reusing, plain = HFPolicy(model, eos), HFPolicy(model, eos, prefix_cache_bytes=0)
    context = _context(3, 40)
    for turn in range(3):
        with_prefix = asyncio.run(reusing.generate(context, GREEDY, "t#0"))
        _same([with_prefix], [asyncio.run(plain.generate(context, GREEDY, "t#0"))])
        context = context + with_prefix.output_ids + _context(20 + turn, 5)
    assert reusing.context_tokens["reused"] > reusing.context_tokens["encoded"] / 2
    reusing.end_session("t#0")
    assert len(reusing.prefixes) == 0 and reusing.prefixes.nbytes == 0


def test_the_store_keeps_within_its_bytes_least_recently_used_out() -> None:
    def prefix(tokens: int) -> Prefix:
        rows = torch.zeros(1, 2, tokens, 4)  # keys and values: 64 bytes a token
        return Prefix(tuple(range(tokens)), ((rows, rows.clone()),))

    store = PrefixStore(max_bytes=64 * 25)
    store.put("a", prefix(10))
    store.put("b", prefix(10))
    assert store.reusable("a", list(range(12)))[0] == 10  # a is now the most recent
    store.put("c", prefix(10))  # over 25 tokens: b goes
    assert store.reusable("b", list(range(12))) == (0, None)
    assert store.reusable("a", list(range(5)))[0] == 4  # all but the last token
    assert store.nbytes == 64 * 20
    store.put("huge", prefix(30))  # larger than the store: not kept, nothing evicted
    assert len(store) == 2 and store.nbytes == 64 * 20
    with pytest.raises(ValueError):
        PrefixStore(max_bytes=-1)


def test_a_model_with_linear_attention_layers_re_encodes() -> None:
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()
    policy = HFPolicy(model, eos_token_id=1)
    context = [5, 6, 7, 8, 9, 10]
    first = asyncio.run(policy.generate(context, GREEDY, "s"))
    asyncio.run(policy.generate(context + first.output_ids + [11], GREEDY, "s"))
    assert policy.context_tokens["reused"] == 0 and len(policy.prefixes) == 0
