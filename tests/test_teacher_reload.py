"""POST /v1/reload: a self-teacher takes new weights (OPSD/OPRD refresh, EMA)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from slime_ext.models.factory import build_checkpoint
from teacher_server.api import ScoreItem
from teacher_server.app import create_app
from teacher_server.client import TeacherClient, TeacherError
from teacher_server.hf_backend import HFBackend
from teacher_server.metrics import ServerMetrics
from tests.live_server import serve_in_thread

KEY = "reload-test-key"
ITEM = ScoreItem(input_ids=[5, 9, 14, 30, 31, 32], span_start=3, session_id="s")


def _direct(model_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ITEM.input_ids])).logits[0]
    rows = torch.log_softmax(logits[2:-1].float(), -1)
    return rows.gather(-1, torch.tensor(ITEM.input_ids[3:])[:, None])[:, 0]


def test_reload_serves_the_new_weights_and_drops_sessions(tmp_path: Path) -> None:
    first = build_checkpoint("qwen3-tiny", tmp_path / "first", seed=1)
    second = build_checkpoint("qwen3-tiny", tmp_path / "second", seed=2)
    metrics = ServerMetrics()
    backend = HFBackend(first, metrics, max_context=1024)
    with serve_in_thread(create_app(backend, metrics, api_key=KEY)) as url:

        async def run() -> Any:
            async with TeacherClient(url, KEY) as client:
                [before] = await client.score([ITEM])
                reloaded = await client.reload(str(second))
                [after] = await client.score([ITEM])
                return before, reloaded, after

        before, reloaded, after = asyncio.run(run())
    assert torch.allclose(torch.tensor(before.logprobs), _direct(first), atol=1e-5)
    assert torch.allclose(torch.tensor(after.logprobs), _direct(second), atol=1e-5)
    assert reloaded.sessions_dropped == 1 and reloaded.model == str(second)
    assert after.cached_tokens == 0  # the old weights' prefix was not reused


def test_reload_needs_a_keyed_server_and_the_same_tokenizer(tmp_path: Path) -> None:
    first = build_checkpoint("qwen3-tiny", tmp_path / "first", seed=1)
    metrics = ServerMetrics()
    with serve_in_thread(create_app(HFBackend(first, metrics), metrics)) as url:
        refused = httpx.post(f"{url}/v1/reload", json={"model_dir": str(first)}, timeout=30)
    assert refused.status_code == 403 and "--api-key" in refused.json()["detail"]
    other = tmp_path / "other"
    shutil.copytree(first, other)
    tokenizer_json = other / "tokenizer.json"
    data = json.loads(tokenizer_json.read_text())
    vocab = data["model"]["vocab"]
    token = next(iter(vocab))
    vocab[token + "x"] = vocab.pop(token)
    tokenizer_json.write_text(json.dumps(data))
    metrics = ServerMetrics()
    with serve_in_thread(create_app(HFBackend(first, metrics), metrics, api_key=KEY)) as url:

        async def run() -> None:
            async with TeacherClient(url, KEY) as client:
                await client.reload(str(other))

        with pytest.raises(TeacherError, match="another tokenizer"):
            asyncio.run(run())
        missing = httpx.post(
            f"{url}/v1/reload",
            json={"model_dir": str(tmp_path / "nowhere")},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=30,
        )
    assert missing.status_code == 400
