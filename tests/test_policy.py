"""Generation backends: the local HF policy and the SGLang client (against the stand-in)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

import rollout.policy
from rollout.policy import GenerationRequest, HFPolicy, SamplingParams, SGLangPolicy
from slime_ext.cpu_runtime.sglang_http import create_standin
from slime_ext.models.factory import build_model
from teacher_server.api import MAX_ROUTING_KEY_LEN, ROUTING_HEADER, routing_key
from tests.live_server import serve_in_thread

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
PROMPT = [5, 17, 99, 230, 41, 8, 77]


@pytest.fixture(scope="module")
def model(factory_tokenizer: Any) -> Any:
    return build_model("qwen3-tiny", factory_tokenizer, seed=5).eval()


def _generate(policy: Any, params: SamplingParams, session: str | None = None) -> Any:
    return asyncio.run(policy.generate(PROMPT, params, session))


def _direct_logprobs(model: Any, output: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT + output])).logits[0].float()
    rows = torch.log_softmax(logits[len(PROMPT) - 1 : -1] / temperature, dim=-1)
    return rows.gather(-1, torch.tensor(output)[:, None])[:, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hf_policy_logprobs_equal_a_direct_forward(model: Any, temperature: float) -> None:
    policy = HFPolicy(model, eos_token_id=model.config.eos_token_id, seed=1)
    generation = _generate(policy, SamplingParams(max_new_tokens=12, temperature=temperature))
    assert generation.finish_reason in ("stop", "length")
    assert len(generation.output_ids) == len(generation.logprobs) <= 12
    expected = _direct_logprobs(model, generation.output_ids, temperature)
    assert torch.allclose(torch.tensor(generation.logprobs), expected, atol=1e-4)


def test_hf_policy_is_reproducible_by_seed_and_greedy_is_argmax(model: Any) -> None:
    params = SamplingParams(max_new_tokens=10)
    first = _generate(HFPolicy(model, model.config.eos_token_id, seed=3), params)
    again = _generate(HFPolicy(model, model.config.eos_token_id, seed=3), params)
    assert first.output_ids == again.output_ids
    greedy = _generate(
        HFPolicy(model, model.config.eos_token_id), SamplingParams(max_new_tokens=6, temperature=0)
    )
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT])).logits[0, -1]
    assert greedy.output_ids[0] == int(logits.argmax())


def test_hf_policy_stops_at_a_stop_id(model: Any) -> None:
    greedy = _generate(
        HFPolicy(model, model.config.eos_token_id), SamplingParams(max_new_tokens=6, temperature=0)
    )
    stop_at = greedy.output_ids[2]
    stopped = _generate(
        HFPolicy(model, model.config.eos_token_id),
        SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=(stop_at,)),
    )
    assert stopped.finish_reason == "stop"
    assert stopped.output_ids == greedy.output_ids[: greedy.output_ids.index(stop_at) + 1]


def test_truncated_sampling_stays_in_the_top_k(model: Any) -> None:
    policy = HFPolicy(model, model.config.eos_token_id, seed=0)
    generation = _generate(policy, SamplingParams(max_new_tokens=1, top_k=3))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT])).logits[0, -1]
    assert generation.output_ids[0] in logits.topk(3).indices.tolist()
    nucleus = _generate(policy, SamplingParams(max_new_tokens=1, top_p=1e-6))
    assert nucleus.output_ids[0] == int(logits.argmax())  # the token that crosses top_p


def test_concurrent_requests_are_batched_and_equal_sequential_ones(model: Any) -> None:
    prompts = [PROMPT, PROMPT[:3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12], PROMPT[2:]]
    params = SamplingParams(max_new_tokens=7, temperature=0)

    async def concurrent() -> list[Any]:  # the batched mode (the default decodes one by one)
        policy = HFPolicy(model, model.config.eos_token_id, batch_invariant=False)
        return list(await asyncio.gather(*(policy.generate(p, params) for p in prompts)))

    async def sequential() -> list[Any]:
        policy = HFPolicy(model, model.config.eos_token_id)
        return [await policy.generate(p, params) for p in prompts]

    together, alone = asyncio.run(concurrent()), asyncio.run(sequential())
    for batched, single in zip(together, alone, strict=True):
        assert batched.output_ids == single.output_ids
        assert torch.allclose(
            torch.tensor(batched.logprobs), torch.tensor(single.logprobs), atol=1e-4
        )


def _two_turns(policy: HFPolicy) -> list[Any]:
    """Two rounds of a batch: contexts of different lengths (left padding), greedy and
    keyed sampled rows, the second round reusing each session's prefix, one row of it
    without a session."""
    sampled = SamplingParams(max_new_tokens=12, temperature=1.0)
    greedy = SamplingParams(max_new_tokens=9, temperature=0)
    contexts = [PROMPT * (1 + i) for i in range(3)]
    params = [
        sampled.model_copy(update={"sampling_key": "a"}),
        greedy,
        sampled.model_copy(update={"sampling_key": "c"}),
    ]
    sessions = ["a", "b", "c"]
    first = asyncio.run(
        policy.generate_batch(
            [GenerationRequest(c, p, s) for c, p, s in zip(contexts, params, sessions, strict=True)]
        )
    )
    later = [c + g.output_ids + [11, 12, 13] for c, g in zip(contexts, first, strict=True)]
    requests = [GenerationRequest(c, p, s) for c, p, s in zip(later, params, sessions, strict=True)]
    second = asyncio.run(policy.generate_batch([*requests, GenerationRequest(PROMPT, greedy)]))
    return [(g.output_ids, g.logprobs, g.finish_reason) for g in [*first, *second]]


@pytest.mark.parametrize("capacity_short_by", [0, 40])
def test_decoding_into_preallocated_buffers_gives_dynamic_caches_bits(
    model: Any, monkeypatch: pytest.MonkeyPatch, capacity_short_by: int
) -> None:
    """The decode cache writes each step into buffers allocated once instead of
    concatenating (rollout/policy._decode_cache): every token and log-prob is the one
    transformers' DynamicCache gives, bit for bit, also where the buffers have to grow."""
    from transformers import DynamicCache

    decode_cache = rollout.policy._decode_cache
    sizes: list[int] = []

    def short(config: Any, capacity: int) -> Any:
        cache = decode_cache(config, capacity - capacity_short_by)
        sizes.append(capacity)
        return cache

    monkeypatch.setattr(rollout.policy, "_decode_cache", short)
    preallocated = _two_turns(HFPolicy(model, eos_token_id=-1, drop_finished=False))
    assert sizes  # the policy decoded through it
    monkeypatch.setattr(rollout.policy, "_decode_cache", lambda c, _: DynamicCache(config=c))
    assert preallocated == _two_turns(HFPolicy(model, eos_token_id=-1, drop_finished=False))


def test_rows_that_finish_leave_the_batch_and_keep_their_prefixes(model: Any) -> None:
    """Rows with different token budgets finish at different steps and leave the batch's
    forwards (3, then 2, then 1 row): each row's tokens are those of a batch that feeds
    them padding to the end, log-probs to float rounding; the prefix a row left when it
    finished early serves its next turn as it does without dropping."""

    def run(drop: bool) -> tuple[list[Any], list[int], HFPolicy]:
        policy = HFPolicy(model, eos_token_id=-1, drop_finished=drop)
        rows: list[int] = []
        hook = model.register_forward_pre_hook(
            lambda _m, _a, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
        )
        try:
            contexts = [PROMPT * (1 + i) for i in range(3)]
            first = asyncio.run(
                policy.generate_batch(
                    [
                        GenerationRequest(
                            c, SamplingParams(max_new_tokens=b, temperature=0), f"{i}"
                        )
                        for i, (c, b) in enumerate(zip(contexts, [3, 12, 7], strict=True))
                    ]
                )
            )
            later = [c + g.output_ids + [11, 12] for c, g in zip(contexts, first, strict=True)]
            greedy = SamplingParams(max_new_tokens=6, temperature=0)
            second = asyncio.run(
                policy.generate_batch(
                    [GenerationRequest(c, greedy, f"{i}") for i, c in enumerate(later)]
                )
            )
        finally:
            hook.remove()
        return [*first, *second], rows, policy

    dropped, dropped_rows, policy = run(True)
    kept, kept_rows, _ = run(False)
    assert dropped_rows[:12] == [3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 1]
    assert set(kept_rows) == {3}
    for a, b in zip(dropped, kept, strict=True):
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    # every session's second turn fed only its new tail: its prefix was kept
    assert policy.context_tokens["reused"] == sum(
        len(PROMPT) * (1 + i) + len(g.output_ids) - 1 for i, g in enumerate(dropped[:3])
    )


@pytest.fixture(scope="module")
def standin(model: Any) -> Iterator[str]:
    with serve_in_thread(create_standin(model, context_length=1024)) as url:
        yield url


def test_sglang_policy_against_the_standin(standin: str, model: Any) -> None:
    async def run() -> Any:
        policy = SGLangPolicy(standin)
        try:
            return await policy.generate(
                PROMPT, SamplingParams(max_new_tokens=8, temperature=0), "traj-3"
            )
        finally:
            await policy.close()

    generation = asyncio.run(run())
    local = _generate(
        HFPolicy(model, model.config.eos_token_id), SamplingParams(max_new_tokens=8, temperature=0)
    )
    assert generation.output_ids == local.output_ids
    assert generation.finish_reason == local.finish_reason
    assert torch.allclose(
        torch.tensor(generation.logprobs), torch.tensor(local.logprobs), atol=1e-4
    )
    headers = httpx.get(f"{standin}/standin/headers").json()
    assert headers[-1][ROUTING_HEADER.lower()] == "traj-3"


def test_routing_keys_stay_ascii_bounded_and_distinct() -> None:
    assert routing_key("traj-3#0") == "traj-3#0"
    long_ids = ["t" * 200 + "#0", "t" * 200 + "#1"]  # equal in their first 128 characters
    keys = [routing_key(session) for session in [*long_ids, "tâche#0", "a\nb"]]
    assert all(key.isascii() and key.isprintable() for key in keys)
    assert all(len(key) <= MAX_ROUTING_KEY_LEN for key in keys)
    assert len(set(keys)) == len(keys)


def test_a_non_ascii_session_id_is_sent_as_its_routing_key(standin: str) -> None:
    async def run() -> Any:
        policy = SGLangPolicy(standin)
        try:
            return await policy.generate(PROMPT, SamplingParams(max_new_tokens=2), "tâche#0")
        finally:
            await policy.close()

    assert asyncio.run(run()).output_ids
    headers = httpx.get(f"{standin}/standin/headers").json()
    assert headers[-1][ROUTING_HEADER.lower()] == routing_key("tâche#0")


ABORTED_RUNNING = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


@pytest.mark.parametrize(
    ("payload", "output_ids", "message"),
    [
        (  # 0.5.23, a running request: the tokens so far
            {
                "output_ids": [7, 9],
                "meta_info": {
                    "finish_reason": ABORTED_RUNNING,
                    "output_token_logprobs": [[-0.5, 7, None], [-1.5, 9, None]],
                },
            },
            [7, 9],
            "Aborted",
        ),
        (  # 0.5.23, a queued request
            {
                "output_ids": [],
                "meta_info": {
                    "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
                    "output_token_logprobs": [],
                },
            },
            [],
            "Abort in waiting queue",
        ),
        (  # earlier releases, a queued request: neither output_ids nor log-probs
            {
                "text": "",
                "meta_info": {
                    "finish_reason": {"type": "abort", "message": "Abort before prefill"}
                },
            },
            [],
            "Abort before prefill",
        ),
        ({"output_ids": [], "meta_info": {"finish_reason": None}}, [], "finish_reason {}"),
    ],
)
def test_sglang_policy_maps_each_abort_shape(
    payload: dict[str, Any], output_ids: list[int], message: str
) -> None:
    async def run() -> Any:
        answer = httpx.MockTransport(lambda request: httpx.Response(200, json=payload))
        policy = SGLangPolicy("http://sglang", transport=answer)
        try:
            return await policy.generate(PROMPT, SamplingParams(max_new_tokens=4), "traj-1")
        finally:
            await policy.close()

    generation = asyncio.run(run())
    assert generation.finish_reason == "abort" and generation.abort_message == message
    assert generation.output_ids == output_ids and len(generation.logprobs) == len(output_ids)
