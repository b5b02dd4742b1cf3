"""Whole-trajectory teacher scoring (POST /v1/score_trajectory): one tree-packed forward
gives every turn's span the log-probs that per-turn scoring gives."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from rollout.chat import ChatRenderer
from rollout.harness.tir import TIRHarness
from rollout.runner import Runner, RunnerConfig
from rollout.trajectory import TrajectoryStatus
from slime_ext.models.factory import build_checkpoint
from teacher_server.api import TrajectoryScoreRequest
from teacher_server.app import create_app
from teacher_server.backend import BadScoreRequest
from teacher_server.client import TeacherClient
from teacher_server.hf_backend import HFBackend
from teacher_server.metrics import ServerMetrics
from teacher_server.sglang_backend import SGLangBackend
from tests.live_server import serve_in_thread
from tests.test_runner import REPLIES, TASKS, ScriptedPolicy

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _run(url: str, factory_tokenizer: Any, mode: str, think_policy: str) -> list[Any]:
    harness = TIRHarness()
    renderer = ChatRenderer(factory_tokenizer, harness.tools, think_policy=think_policy)  # type: ignore[arg-type]

    async def run() -> Any:
        async with TeacherClient(url) as teacher:
            runner = Runner(
                harness,
                ScriptedPolicy(renderer, REPLIES),
                renderer,
                RunnerConfig(concurrency=3, teacher_scoring=mode, teacher_top_k=3),  # type: ignore[arg-type]
                teacher=teacher,
            )
            return await runner.run(TASKS)

    return asyncio.run(run())


@pytest.mark.parametrize(
    ("preset", "think_policy"),
    [("qwen3-tiny", "drop"), ("qwen3-tiny", "keep"), ("qwen3_5-tiny", "drop")],
)
def test_trajectory_scoring_equals_per_turn_scoring(
    factory_tokenizer: Any, tmp_path: Path, preset: str, think_policy: str
) -> None:
    """qwen3_5-tiny: a hybrid teacher, its linear-attention branches run from the trunk's
    states (per-turn scoring reuses its session's snapshots instead)."""
    teacher_dir = build_checkpoint(preset, tmp_path / "teacher", seed=8)
    metrics = ServerMetrics()
    backend = HFBackend(teacher_dir, metrics, max_context=4096)
    with serve_in_thread(create_app(backend, metrics)) as url:
        per_turn = _run(url, factory_tokenizer, "per_turn", think_policy)
        before = metrics.tokens_computed_total
        whole = _run(url, factory_tokenizer, "trajectory", think_policy)
        computed = metrics.tokens_computed_total - before
    for a, b in zip(per_turn, whole, strict=True):
        assert b.status is TrajectoryStatus.COMPLETED
        for x, y in zip(a.turns, b.turns, strict=True):
            assert y.teacher_logprobs is not None and x.teacher_logprobs is not None
            assert torch.allclose(
                torch.tensor(x.teacher_logprobs), torch.tensor(y.teacher_logprobs), atol=1e-5
            )
            assert y.teacher_topk_ids is not None and x.teacher_topk_ids == y.teacher_topk_ids
    # each trajectory's tokens once: its trunk plus the spans it does not hold
    bound = sum(len(t.trunk_ids) + t.span_token_count() for t in whole)
    assert computed <= bound


def test_bad_trajectory_requests_are_400(factory_tokenizer: Any, tmp_path: Path) -> None:
    teacher_dir = build_checkpoint("qwen3-tiny", tmp_path / "teacher", seed=8)
    for model_dir, body, message in [
        (
            teacher_dir,
            {"trunk_ids": [1, 2, 3], "turns": [{"context_len": 5, "span_ids": [4]}]},
            "past the trunk",
        ),
        (
            teacher_dir,
            {
                "trunk_ids": [1, 2, 3, 4],
                "turns": [{"context_len": 3, "span_ids": [4]}, {"context_len": 2, "span_ids": [5]}],
            },
            "longer than the previous",
        ),
    ]:
        metrics = ServerMetrics()
        backend = HFBackend(model_dir, metrics, max_context=4096)
        with serve_in_thread(create_app(backend, metrics)) as url:
            response = httpx.post(f"{url}/v1/score_trajectory", json=body, timeout=60)
        assert response.status_code == 400, response.text
        assert message in response.json()["detail"]


def test_sglang_backend_refuses_whole_trajectories(factory_tokenizer: Any) -> None:
    backend = SGLangBackend(
        "http://127.0.0.1:1",
        factory_tokenizer,
        ServerMetrics(),
        model_name="standin",
        tokenizer_identity="standin@0",
    )
    request = TrajectoryScoreRequest(trunk_ids=[1, 2], turns=[{"context_len": 2, "span_ids": [3]}])  # type: ignore[list-item]
    with pytest.raises(BadScoreRequest, match="session_id"):
        asyncio.run(backend.score_trajectory(request))
