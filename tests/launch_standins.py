"""Test-only stand-ins shared by the real-cluster launch tests (tests/test_launch_slurm.py,
tests/test_launch_ssh.py): a checkout of slime whose programs are stand-ins, named as such
(`cluster.slime_dir`: a train.py that probes the cluster the plan built instead of
training, a no-op checkpoint converter, a MODEL_ARGS script), and the teacher's key.

The stand-in train.py writes run_dir/standin-train.json: the alive Ray nodes and their
resources, a Ray task on a GPU node calling the teacher with the key Ray expanded from its
node's environment (and without it), a task on the sandbox host. With run_dir/hold present
it first writes run_dir/holding and stays "in training" up to 120 s (kill tests). With
run_dir/checkpointing present it "trains" as slime's loop saves: from the checkpoint
Megatron's tracker names in --load (else step 0) to --num-rollout, a checkpoint
iter_{i:07d} (then the tracker) every --save-interval steps into --save, a line per step
in run_dir/standin-steps.jsonl (the step, WANDB_RUN_ID, WANDB_RESUME); with
run_dir/stop-after holding K it exits 1 after this launch's K-th checkpoint (a job that
dies mid-run).
"""

from __future__ import annotations

import random
from pathlib import Path

from tests.ports import ray_port_block

KEY_NAME = "OPD_SLURM_TEST_TEACHER_KEY"
KEY_VALUE = "k-" + "".join(random.choice("abcdef0123456789") for _ in range(24))
LEFTOVERS = (
    "raylet", "gcs_server", "opd-teacher", "dashboard/agent.py", "slime-standin", "ray::",
    "multiprocessing.spawn", "sglang_router", "launch.prune_checkpoints",
)  # fmt: skip
"""What a job's processes look like: Ray's, the teacher's, the stand-in train.py's, Ray's
workers and actors, the engines slime spawns, the router, the checkpoint pruner."""
TRAIN_STANDIN = '''"""Stand-in for slime's train.py (tests/launch_standins.py): probes the
cluster the plan built and writes what it saw next to the job config; trains nothing."""
import json, os, sys, time
from pathlib import Path

print("standin train.py in", sys.executable, "PATH", os.environ.get("PATH"), flush=True)
import httpx, ray, yaml

job = yaml.safe_load(Path(os.environ["OPD_JOB_CONFIG"]).read_text())
key_name, url = job["teacher"]["api_key_env"], job["teacher"]["url"]
ray.init(address="auto", logging_level="ERROR")
nodes = [
    {"ip": n["NodeManagerAddress"], "resources": n["Resources"]}
    for n in ray.nodes() if n["Alive"]
]


@ray.remote(num_gpus=1)
def on_a_training_node():
    key = os.environ.get(key_name, "")
    item = {"input_ids": [1, 2, 3, 4], "span_start": 2}
    scored = httpx.post(
        f"{url}/v1/score", json={"requests": [item]},
        headers={"Authorization": f"Bearer {key}"}, timeout=60,
    )
    refused = httpx.post(f"{url}/v1/score", json={"requests": [item]}, timeout=60)
    return {
        "ip": ray.util.get_node_ip_address(), "key_set": bool(key),
        "key_unexpanded": key.startswith("${"), "with_key": scored.status_code,
        "without_key": refused.status_code,
    }


@ray.remote(num_cpus=0, resources={"opd_sandbox_host": 1})  # the host offers no CPU
def on_the_sandbox_host():
    return {"ip": ray.util.get_node_ip_address(), "gpus": ray.get_gpu_ids()}


run = Path(job["logging"]["run_dir"])


def flag(name):
    return sys.argv[sys.argv.index(name) + 1]


if (run / "checkpointing").exists():  # slime's loop, as far as checkpoints go
    load, save = Path(flag("--load")), Path(flag("--save"))
    interval, rollouts = int(flag("--save-interval")), int(flag("--num-rollout"))
    tracker = load / "latest_checkpointed_iteration.txt"
    start = int(tracker.read_text()) + 1 if tracker.exists() else 0
    stop_after = run / "stop-after"
    saved = 0
    for step in range(start, rollouts):
        with (run / "standin-steps.jsonl").open("a") as log:
            log.write(json.dumps({
                "step": step, "wandb_run_id": os.environ.get("WANDB_RUN_ID"),
                "wandb_resume": os.environ.get("WANDB_RESUME"),
            }) + "\\n")
        time.sleep(0.5)
        if (step + 1) % interval == 0:
            (save / f"iter_{step:07d}").mkdir(parents=True, exist_ok=True)
            (save / f"iter_{step:07d}" / "weights.pt").write_text(str(step))
            (save / "latest_checkpointed_iteration.txt").write_text(str(step))
            saved += 1
            if stop_after.exists() and saved == int(stop_after.read_text()):
                print("standin train.py: dying after checkpoint", step, flush=True)
                sys.exit(1)
            time.sleep(1.0)  # a pass of the pruner may run meanwhile
hold, holding = run / "hold", run / "holding"
if hold.exists():  # a kill test: stay "in training" until the job is stopped (at most 120 s)
    holding.write_text("")
    for _ in range(240):
        time.sleep(0.5)
report = {
    "nodes": nodes,
    "training": ray.get(on_a_training_node.remote(), timeout=120),
    "sandbox": ray.get(on_the_sandbox_host.remote(), timeout=120),
    "argv": sys.argv[1:],
}
out = Path(os.environ["OPD_JOB_CONFIG"]).parent / "standin-train.json"
out.write_text(json.dumps(report))
print("standin train.py:", json.dumps(report))
'''
CONVERT_STANDIN = '''"""Stand-in for slime's tools/convert_hf_to_torch_dist.py: marks --save
converted."""
import os, sys
from pathlib import Path

save = Path(sys.argv[sys.argv.index("--save") + 1])
if os.environ.get("RANK", "0") == "0":
    save.mkdir(parents=True, exist_ok=True)
    (save / "latest_checkpointed_iteration.txt").write_text("release")
'''


def standin_tasks(path: Path) -> Path:
    """A tasks file of two math rows as `opd tasks write` makes them (the stand-in train.py
    reads none; validate and the launch read its first rows)."""
    import json

    from launch.tasks_file import task_row
    from rollout.tasks.arithmetic import make_tasks

    path.write_text("".join(json.dumps(task_row(t)) + "\n" for t in make_tasks(2, "train")))
    return path


def standin_slime(directory: Path) -> Path:
    """A checkout of slime whose programs are stand-ins (the cluster.slime_dir)."""
    slime = directory / "slime-standin"
    (slime / "tools").mkdir(parents=True)
    (slime / "scripts/models").mkdir(parents=True)
    (slime / "train.py").write_text(TRAIN_STANDIN)
    (slime / "tools/convert_hf_to_torch_dist.py").write_text(CONVERT_STANDIN)
    (slime / "scripts/models/tiny.sh").write_text("MODEL_ARGS=(--num-layers 2)\n")
    return slime


def ray_node_args(temp: Path, node: str, index: str, cpus: int = 2) -> list[str]:
    """Several Ray nodes on one host: each its own temp dir and port block (REFERENCE.md,
    Slurm and Ray on one host). `node` and `index` are shell expressions a node's step
    expands to its name and a small number (e.g. from SLURMD_NODENAME or SSH_CONNECTION).
    The temp dir is short: Ray's sockets live under it (Unix socket paths hold 107
    bytes)."""
    base = ray_port_block()
    port = f"$(({base} + ({index}) % 10 * 100"  # an address's last octet (11+) stays in its block
    return [
        f"--temp-dir={temp}/{node}",
        f"--num-cpus={cpus}",
        f"--node-manager-port={port}))",
        f"--object-manager-port={port} + 1))",
        f"--metrics-export-port={port} + 2))",
        f"--dashboard-agent-listen-port={port} + 3))",
        f"--dashboard-agent-grpc-port={port} + 4))",
        f"--runtime-env-agent-port={port} + 5))",
        f"--min-worker-port={port} + 10))",
        f"--max-worker-port={port} + 99))",
    ]
