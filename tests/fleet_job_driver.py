"""Test-only (tests/test_fleet_job.py): slime's rollout process on a cluster, in its own
process joined to a real multi-node Ray cluster on this host. It runs our generate hook
through slime's generate_and_rm_group for a batch of mini-SWE samples (the SGLang side
answered by the stand-in, whose model replays a script of bash turns and a submit; the
teacher our real service on a factory model) with the job's sandboxes on the Ray nodes
offering the sandbox-host resource. Once every sandbox node holds a started sandbox it
kills one node's whole session (a machine lost), then prints one JSON line: each sample's
status and reason, where its sandboxes were placed and when.

    python -m tests.fleet_job_driver SPEC.json
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

SCRIPT_COMMAND = "sleep 1; echo turn-done"
BASH_TURNS = 3
FRESH_S = 1.0
"""A sandbox started this recently has its trajectory's commands (3 s at least) ahead."""


class ScriptedModel(torch.nn.Module):
    """Stands in for the student behind SGLang: after each assistant header it emits the
    next turn of a fixed script (BASH_TURNS bash calls, then submit), token by token."""

    def __init__(self, turns: list[list[int]], header: list[int], vocab_size: int, eos: int):
        super().__init__()
        self.turns, self.header, self.vocab_size = turns, header, vocab_size
        self.config = type("Config", (), {"eos_token_id": eos})()

    def forward(self, input_ids: torch.Tensor) -> Any:
        ids = input_ids[0].tolist()
        width = len(self.header)
        starts = [
            i + width for i in range(len(ids) - width + 1) if ids[i : i + width] == self.header
        ]
        turn = self.turns[min(len(starts) - 1, len(self.turns) - 1)]
        written = len(ids) - starts[-1]
        token = turn[written] if written < len(turn) else self.config.eos_token_id
        logits = torch.full((1, len(ids), self.vocab_size), -30.0)
        logits[0, -1, token] = 30.0
        return type("Output", (), {"logits": logits})()


def _kill_node(spec: dict[str, Any]) -> None:
    os.killpg(spec["kill_pgid"], signal.SIGKILL)
    subprocess.run(["pkill", "-KILL", "-f", spec["kill_temp_dir"]], check=False)


async def _drive(spec: dict[str, Any], args: Any, router: str, tokenizer_dir: str) -> dict:
    from slime.rollout.sglang_rollout import GenerateState, generate_and_rm_group
    from slime.utils.types import Sample

    from rollout.tasks.mini_swe import generate_tasks
    from slime_ext.slime import generate as hook
    from slime_ext.slime.samples import METADATA_KEY
    from slime_ext.slime.settings import config_path

    GenerateState.clear_instances()
    state = hook._state(config_path(args), router, tokenizer_dir, id(asyncio.get_running_loop()))
    assert state.sandboxes is not None
    await state.sandboxes.open()
    fleet = state.sandboxes.fleet
    assert fleet is not None
    harness: Any = state.runner.harness
    factory = harness.sandbox_factory
    sample_of: contextvars.ContextVar[int] = contextvars.ContextVar("sample")
    placed: dict[int, list[tuple[Any, float]]] = {}

    def recording(image: str | None) -> Any:
        sandbox, index = factory(image), sample_of.get()
        start = sandbox.start

        async def placed_start() -> None:  # when its first start ended: placed, running
            await start()
            mine = placed.setdefault(index, [])
            if all(seen is not sandbox for seen, _ in mine):
                mine.append((sandbox, time.monotonic()))

        sandbox.start = placed_start
        return sandbox

    harness.sandbox_factory = recording
    tasks = generate_tasks(spec["samples"], seed=5)

    async def one(index: int) -> Any:
        sample_of.set(index)
        task = tasks[index]
        base = Sample(
            index=index, group_index=index, prompt=task.prompt, metadata={"task": task.model_dump()}
        )
        [samples] = await generate_and_rm_group(args, [base], {})
        finished[index] = time.monotonic()
        return samples

    finished: dict[int, float] = {}
    running = [asyncio.create_task(one(i)) for i in range(spec["samples"])]
    killed_at = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(t.done() for t in running):
        now, started = time.monotonic(), {}  # host -> start times of unfinished trajectories
        for index, boxes in placed.items():
            for sandbox, at in boxes if index not in finished else ():
                started.setdefault(sandbox.host_name, []).append(at)
        fresh = [at for at in started.get(spec["kill_host"], []) if now - at < FRESH_S]
        # every node runs a trajectory, and the doomed node one with its commands ahead
        if set(started) >= set(fleet.metrics()["hosts"]) and fresh:
            _kill_node(spec)
            killed_at = time.monotonic()
            break
        await asyncio.sleep(0.05)
    results = await asyncio.gather(*running)
    out = []
    for index, samples in enumerate(results):
        summary = samples[0].metadata[METADATA_KEY]
        out.append(
            {
                "index": index,
                "status": summary["status"],
                "reason": summary["status_reason"],
                "reward": summary["reward"],
                "num_turns": summary["num_turns"],
                "finished_before_kill": killed_at is not None and finished[index] < killed_at,
                "sandboxes": [
                    {
                        "host": sandbox.host_name,
                        "started_s_after_kill": None if killed_at is None else started - killed_at,
                    }
                    for sandbox, started in placed.get(index, [])
                ],
            }
        )
    await state.sandboxes.close()  # the lost node's host cannot shut down: unreaped
    metrics = fleet.metrics()
    return {"killed": killed_at is not None, "trajectories": out, "fleet": metrics}


def main(spec_path: str) -> None:
    from tests import slime_cpu

    slime_cpu.install()
    import ray

    from rollout.chat import ChatRenderer
    from rollout.harness.swe import SWEHarness
    from rollout.toolcalls import ToolCall
    from slime_ext.cpu_runtime.sglang_http import create_standin
    from slime_ext.job.config import config_from_dict
    from slime_ext.models.factory import build_checkpoint, build_tokenizer
    from teacher_server.app import create_app
    from teacher_server.hf_backend import HFBackend
    from teacher_server.metrics import ServerMetrics
    from tests.live_server import serve_in_thread
    from tests.slime_driver import slime_args

    spec = json.loads(Path(spec_path).read_text())
    work = Path(spec["work_dir"])
    ray.init(address=spec["gcs_address"], _node_ip_address="127.0.0.2", logging_level="ERROR")
    teacher_dir = build_checkpoint("qwen3-tiny", work / "teacher")
    tokenizer = build_tokenizer()
    renderer = ChatRenderer(tokenizer, SWEHarness().tools, think_policy="drop")
    calls = [ToolCall(name="bash", arguments={"command": SCRIPT_COMMAND})] * BASH_TURNS
    calls.append(ToolCall(name="submit", arguments={}))
    turns = [
        renderer.scripted_span_ids(
            {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]}
        )
        for call in calls
    ]
    header = renderer.encode("<|im_start|>assistant\n")
    student = ScriptedModel(turns, header, len(tokenizer), renderer.eos_id)
    metrics = ServerMetrics()
    backend = HFBackend(teacher_dir, metrics, max_context=8192)
    with (
        serve_in_thread(create_standin(student, context_length=8192)) as router,
        serve_in_thread(create_app(backend, metrics)) as teacher_url,
    ):
        job = config_from_dict(
            {
                "model": {"tokenizer": str(teacher_dir)},
                "rollout": {
                    "harness": "swe",
                    "max_turns": BASH_TURNS + 2,
                    "max_new_tokens": 64,
                    "max_context_tokens": 8192,
                    "concurrency": spec["samples"],
                    "trajectory_timeout_s": 120,
                },
                "sandbox": {
                    "backend": spec["backend"],
                    "image": spec.get("image"),
                    "hosts": "ray",
                    "command_timeout_s": 10,
                    "max_sandboxes": spec["max_sandboxes"],
                },
                "teacher": {"kind": "remote", "url": teacher_url},
                "algorithm": {"recipe": "opd"},
                "logging": {"run_dir": str(work / "run")},
            }
        )
        host, port = router.removeprefix("http://").split(":")
        args = slime_args(job, work)
        args.sglang_router_ip, args.sglang_router_port = host, int(port)
        args.hf_checkpoint, args.rollout_num_gpus = str(teacher_dir), 1
        report = asyncio.run(_drive(spec, args, router, str(teacher_dir)))
    print("RESULT " + json.dumps(report), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
