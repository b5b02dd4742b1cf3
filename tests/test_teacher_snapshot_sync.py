"""`opd-teacher sync`: OPSD's ema / refresh snapshot on a cluster, against a real teacher
service (hf backend, API key). slime's converter needs Megatron, slime and a torch_dist
checkpoint, so tests named `..._with_a_standin_converter` convert with
tests/megatron_converter_standin.py, whose "checkpoints" are iter_ directories holding an
HF state dict with a Megatron-padded embedding; `test_real_slime_converter_*` runs where
slime and Megatron are importable."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi import Request, Response
from fastapi.responses import JSONResponse
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from slime_ext.models.factory import build_checkpoint
from teacher_server.api import ScoreItem
from teacher_server.app import create_app
from teacher_server.cli import app as teacher_cli
from teacher_server.client import TeacherClient
from teacher_server.hf_backend import HFBackend
from teacher_server.metrics import ServerMetrics
from teacher_server.snapshot_sync import (
    TRACKER,
    SnapshotSync,
    SyncConfig,
    SyncError,
    refresh_steps,
    slime_converter,
    snapshot_steps,
)
from tests import megatron_converter_standin as converter_standin
from tests.live_server import serve_in_thread

KEY = "sync-test-key"
ITEM = ScoreItem(input_ids=[5, 9, 14, 30, 31, 32, 40, 41], span_start=3)


@pytest.fixture(scope="module")
def origin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The student's initial HF checkpoint: what the teacher serves first."""
    return build_checkpoint("qwen3-tiny", tmp_path_factory.mktemp("origin") / "m", seed=1)


@pytest.fixture()
def teacher(origin: Path) -> Iterator[str]:
    metrics = ServerMetrics()
    with serve_in_thread(create_app(HFBackend(origin, metrics), metrics, api_key=KEY)) as url:
        yield url


def _student_weights(origin: Path, seed: int) -> dict[str, torch.Tensor]:
    """The initial weights moved by seeded noise: the student after some training."""
    generator = torch.Generator().manual_seed(seed)
    return {
        k: v + 0.05 * torch.randn(v.shape, generator=generator)
        for k, v in load_file(origin / "model.safetensors").items()
    }


def _config(tmp_path: Path, origin: Path, url: str, **fields: Any) -> SyncConfig:
    converter = converter_standin.command(log=tmp_path / "conversions.log")
    base: dict[str, Any] = {
        "mode": "refresh",
        "teacher_url": url,
        "api_key": KEY,
        "save_dir": tmp_path / "save",
        "work_dir": tmp_path / "work",
        "origin_hf_dir": origin,
        "steps": 4,
        "refresh_at": [0.5],
        "converter": converter,
        "reload_backoff_s": 0.01,
        "poll_interval_s": 0.05,
    }
    return SyncConfig.model_validate({**base, **fields})


def _conversions(tmp_path: Path) -> list[str]:
    log = tmp_path / "conversions.log"
    return [Path(line).name for line in log.read_text().splitlines()] if log.is_file() else []


def _served_logprobs(url: str) -> tuple[str, torch.Tensor]:
    async def run() -> tuple[str, list[float]]:
        async with TeacherClient(url, KEY) as client:
            [result] = await client.score([ITEM])
            return (await client.info()).model, result.logprobs

    model, logprobs = asyncio.run(run())
    return model, torch.tensor(logprobs)


def _direct_logprobs(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ITEM.input_ids])).logits[0]
    rows = torch.log_softmax(logits[ITEM.span_start - 1 : -1].float(), -1)
    return rows.gather(-1, torch.tensor(ITEM.input_ids[ITEM.span_start :])[:, None])[:, 0]


def _model_with(origin: Path, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(origin, dtype=torch.float32).eval()
    model.load_state_dict(weights, strict=False)  # lm_head is tied to the embedding
    return model


def _state(tmp_path: Path) -> dict[str, Any]:
    return json.loads((tmp_path / "work/state.json").read_text())


def test_refresh_steps_are_the_local_trainers() -> None:
    """The first step whose end reaches each fraction; 0.7 of 10 is step 7 (not
    ceil(0.7 * 10) = 8 in floating point)."""
    assert refresh_steps([0.2, 0.4, 0.6, 0.8], 200) == [40, 80, 120, 160]
    assert refresh_steps([0.7], 10) == [7]
    assert refresh_steps([0.25, 0.26], 10) == [3]
    assert refresh_steps([1.0], 3) == [3]
    assert snapshot_steps("refresh", 3, [0.5, 1.0], 5) == [2]  # none after the last step
    assert snapshot_steps("ema", 20, [], 5) == [5, 10, 15]


def test_refresh_serves_the_students_checkpoint_with_a_standin_converter(
    tmp_path: Path, origin: Path, teacher: str
) -> None:
    config = _config(tmp_path, origin, teacher)
    leftover = tmp_path / "work/tmp/step_00002"  # a conversion killed half-way
    leftover.mkdir(parents=True)
    (leftover / "partial.safetensors").write_text("")
    student = _student_weights(origin, seed=7)
    converter_standin.write_checkpoint(config.save_dir, 2, student)
    SnapshotSync(config).run()
    served, logprobs = _served_logprobs(teacher)
    assert served == str(tmp_path / "work/converted/step_00002")
    assert torch.allclose(logprobs, _direct_logprobs(_model_with(origin, student)), atol=1e-5)
    assert not torch.allclose(logprobs, _direct_logprobs(_model_with(origin, {})), atol=1e-3)
    assert _state(tmp_path)["applied"] == [2]
    assert _conversions(tmp_path) == ["iter_0000001"]
    assert list((tmp_path / "work/tmp").iterdir()) == []


def test_ema_averages_three_checkpoints_with_decay_to_the_steps_between_with_a_standin_converter(
    tmp_path: Path, origin: Path, teacher: str
) -> None:
    """ema_every 2 over 7 steps: checkpoints of steps 2, 4, 6, each weighted 1 - decay**2
    against the average so far, which starts at the initial weights."""
    decay = 0.9
    config = _config(tmp_path, origin, teacher, mode="ema", steps=7, ema_decay=decay, ema_every=2)
    initial = load_file(origin / "model.safetensors")
    students = {step: _student_weights(origin, seed=step) for step in (2, 4, 6)}
    for step, weights in students.items():
        converter_standin.write_checkpoint(config.save_dir, step, weights)
    SnapshotSync(config).run()

    served_dir = tmp_path / "work/ema/step_00006"
    averaged = {}
    for shard in served_dir.glob("*.safetensors"):
        averaged.update(load_file(shard))
    assert set(averaged) == set(initial)
    kept = decay**2
    for name, start in initial.items():
        recursion = start.float()
        for step in (2, 4, 6):
            recursion = recursion * kept + students[step][name].float() * (1 - kept)
        assert averaged[name].dtype == torch.float32
        assert torch.equal(averaged[name], recursion), name
        closed_form = decay**6 * start.double() + (1 - kept) * (
            kept**2 * students[2][name].double()
            + kept * students[4][name].double()
            + students[6][name].double()
        )
        assert torch.allclose(averaged[name].double(), closed_form, atol=1e-6), name

    served, logprobs = _served_logprobs(teacher)
    assert served == str(served_dir)
    assert torch.allclose(logprobs, _direct_logprobs(_model_with(origin, averaged)), atol=1e-5)
    assert _state(tmp_path)["applied"] == [2, 4, 6]
    assert sorted(p.name for p in (tmp_path / "work/ema").iterdir()) == ["step_00006"]
    assert list((tmp_path / "work/converted").iterdir()) == []  # consumed, removed


def test_a_checkpoint_the_tracker_does_not_name_is_not_used_with_a_standin_converter(
    tmp_path: Path, origin: Path, teacher: str
) -> None:
    config = _config(tmp_path, origin, teacher)
    sync = SnapshotSync(config)
    converter_standin.write_checkpoint(
        config.save_dir, 2, _student_weights(origin, seed=3), complete=False
    )
    assert sync.apply_ready() is False  # iter_0000001 exists, the tracker names nothing
    (config.save_dir / TRACKER).write_text("0")
    assert sync.apply_ready() is False  # the tracker names the step before
    assert _conversions(tmp_path) == [] and _served_logprobs(teacher)[0] == str(origin)
    (config.save_dir / TRACKER).write_text("1")
    assert sync.apply_ready() is True
    assert _conversions(tmp_path) == ["iter_0000001"]


def test_a_checkpoint_that_was_never_saved_is_reported(
    tmp_path: Path, origin: Path, teacher: str
) -> None:
    """The tracker passed step 2 without its iter_ directory: --save-interval skipped it."""
    config = _config(tmp_path, origin, teacher)
    config.save_dir.mkdir()
    (config.save_dir / TRACKER).write_text("2")
    with pytest.raises(SyncError, match=r"step 2 .* was never saved.*--save-interval"):
        SnapshotSync(config).apply_ready()


@pytest.mark.timeout(180)
def test_restart_after_a_kill_does_not_reapply_with_a_standin_converter(
    tmp_path: Path, origin: Path, teacher: str
) -> None:
    """Refreshes after steps 2 and 3 of 4; killed while waiting for step 3: the restart
    neither converts nor reloads step 2 again, applies step 3 and exits."""
    config = _config(tmp_path, origin, teacher, refresh_at=[0.5, 0.75])

    def start() -> subprocess.Popen[bytes]:
        argv = [
            sys.executable, "-m", "teacher_server", "sync", "--mode", "refresh",
            "--teacher-url", teacher, "--save-dir", str(config.save_dir),
            "--work-dir", str(config.work_dir), "--origin-hf-dir", str(origin),
            "--steps", "4", "--refresh-at", "0.5", "--refresh-at", "0.75",
            "--converter", config.converter, "--poll-interval-s", "0.1",
        ]  # fmt: skip
        log = (tmp_path / "sync.log").open("ab")
        env = {**os.environ, "OPD_TEACHER_API_KEY": KEY}
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)

    converter_standin.write_checkpoint(config.save_dir, 2, _student_weights(origin, seed=2))
    first = start()
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "work/state.json").is_file() and time.monotonic() < deadline:
            assert first.poll() is None, (tmp_path / "sync.log").read_text()
            time.sleep(0.1)
        assert _state(tmp_path)["applied"] == [2]
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    log_before = (tmp_path / "sync.log").read_text()

    final = _student_weights(origin, seed=4)
    converter_standin.write_checkpoint(config.save_dir, 3, final)
    second = start()
    assert second.wait(timeout=120) == 0, (tmp_path / "sync.log").read_text()
    restart_log = (tmp_path / "sync.log").read_text()[len(log_before) :]
    assert _conversions(tmp_path) == ["iter_0000001", "iter_0000002"]
    assert "reloading" not in restart_log  # the teacher still served step 2's snapshot
    assert "step 3: the teacher serves" in restart_log
    assert _state(tmp_path)["applied"] == [2, 3]
    served, logprobs = _served_logprobs(teacher)
    assert served == str(tmp_path / "work/converted/step_00003")
    assert torch.allclose(logprobs, _direct_logprobs(_model_with(origin, final)), atol=1e-5)
    assert [p.name for p in (tmp_path / "work/converted").iterdir()] == ["step_00003"]


def test_reload_failures_are_retried_then_reported_with_a_standin_converter(
    tmp_path: Path, origin: Path
) -> None:
    metrics = ServerMetrics()
    service = create_app(HFBackend(origin, metrics), metrics, api_key=KEY)
    failures = {"left": 0, "calls": 0}

    @service.middleware("http")
    async def failing_reload(request: Request, call_next: Any) -> Response:
        if request.url.path == "/v1/reload":
            failures["calls"] += 1
            if failures["left"] > 0:
                failures["left"] -= 1
                return JSONResponse({"detail": "injected failure"}, status_code=500)
        response: Response = await call_next(request)
        return response

    with serve_in_thread(service) as url:
        config = _config(tmp_path, origin, url, reload_attempts=3)
        converter_standin.write_checkpoint(config.save_dir, 2, _student_weights(origin, seed=5))
        failures["left"] = 10
        with pytest.raises(SyncError, match=r"reload .* failed 3 times; last: .*injected"):
            SnapshotSync(config).run()
        assert failures["calls"] == 3
        assert not (tmp_path / "work/state.json").exists()  # step 2 is not recorded

        failures.update(left=2, calls=0)
        SnapshotSync(config).run()  # the restart reuses the conversion
        assert failures["calls"] == 3 and _state(tmp_path)["applied"] == [2]
        assert _conversions(tmp_path) == ["iter_0000001"]

        wrong_key = config.model_copy(update={"api_key": "wrong"})
        failures["calls"] = 0
        with pytest.raises(SyncError, match="refused the API key"):
            SnapshotSync(wrong_key).restore()  # a key is not retried


def test_bad_input_is_refused(tmp_path: Path, origin: Path) -> None:
    def refused(**fields: Any) -> str:
        with pytest.raises(ValueError) as caught:
            _config(tmp_path, origin, "http://127.0.0.1:1", **fields)
        return str(caught.value)

    assert "needs {input_dir} and {output_dir}" in refused(converter="convert {input_dir}")
    assert "may name only" in refused(converter="convert {input_dir} {output_dir} {ckpt}")
    assert "fractions of training in (0, 1]" in refused(refresh_at=[0.0, 0.5])
    assert "no snapshot step before the last step 4" in refused(mode="ema", ema_every=4)
    assert "no snapshot step before the last step 4" in refused(refresh_at=[0.9, 1.0])
    assert "no HF checkpoint" in refused(origin_hf_dir=tmp_path)

    config = _config(tmp_path, origin, "http://127.0.0.1:1")
    config.work_dir.mkdir()
    other = config.model_copy(update={"steps": 8})
    (config.work_dir / "state.json").write_text(
        json.dumps({"schedule": other.schedule(), "applied": [4]})
    )
    with pytest.raises(SyncError, match="belongs to another sync"):
        SnapshotSync(config)

    runner = CliRunner()
    base = [
        "sync", "--mode", "refresh", "--save-dir", str(tmp_path), "--work-dir",
        str(tmp_path / "w"), "--origin-hf-dir", str(origin), "--steps", "4",
    ]  # fmt: skip
    no_key = runner.invoke(teacher_cli, base, env={"OPD_TEACHER_API_KEY": ""})
    assert no_key.exit_code == 2 and "needs its API key" in no_key.output
    bad = runner.invoke(teacher_cli, [*base, "--api-key", "k", "--mode", "average"])
    assert bad.exit_code == 2 and "mode: Input should be 'ema' or 'refresh'" in bad.output


def test_a_failing_converter_is_reported_with_its_output(
    tmp_path: Path, origin: Path, teacher: str
) -> None:
    converter = "echo 'no GPU here' >&2; exit 3; {input_dir} {output_dir}"
    config = _config(tmp_path, origin, teacher, converter=converter)
    converter_standin.write_checkpoint(config.save_dir, 2, _student_weights(origin, seed=6))
    with pytest.raises(SyncError, match=r"converting step 2 failed \(exit 3.*\n.*no GPU here"):
        SnapshotSync(config).apply_ready()
    assert _served_logprobs(teacher)[0] == str(origin)


@pytest.mark.skipif(
    importlib.util.find_spec("slime") is None or importlib.util.find_spec("megatron") is None,
    reason="slime's converter needs slime and Megatron (slime's image)",
)
def test_real_slime_converter_takes_the_command_the_sync_runs(tmp_path: Path) -> None:
    """The default converter command, filled in as the sync fills it, reaches slime's
    argument parser (--help: nothing is converted) with every flag known to it."""
    import megatron
    import slime

    slime_dir = Path(slime.__file__).resolve().parents[1]
    megatron_dir = Path(megatron.__path__[0]).resolve().parent
    template = slime_converter(str(slime_dir), str(megatron_dir))
    command = template.format(
        input_dir=tmp_path / "iter_0000001",
        output_dir=tmp_path / "hf",
        origin_hf_dir=tmp_path / "origin",
        vocab_size=1024,
    )
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # its python3
    done = subprocess.run(
        ["bash", "-c", f"{command} --help"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PATH": path},
    )
    assert done.returncode == 0, done.stderr
    for flag in ("--input-dir", "--output-dir", "--origin-hf-dir", "--vocab-size"):
        assert flag in template and flag in done.stdout
