"""`opd launch CONFIG --rehearse`: the user's job at rehearsal scale on this machine.

The job of CONFIG, its flags, hooks, recipe, sequence layout, teacher port, sandbox hosts
and plan, with what cannot run here replaced and said so (each replacement is a note in
the report):

- the student: a tiny model of its architecture (the factory's Qwen3; for another
  architecture the nearest one the CPU runtime trains, dense Qwen3), converted to
  Megatron by the plan's own conversion step; the teacher: a larger tiny Qwen3 sharing
  the student's tokenizer, served by `opd-teacher serve` (the HF backend: SGLang needs
  CUDA);
- the nodes: every node of the config becomes a loopback address of this host (one Ray
  node each, its own temp dir and ports): the head, the teacher's node, each sandbox host.
  The training workers are not started (one training node, one fake GPU, TP = CP = 1;
  with `colocate: false`, a second fake GPU for the engine);
- every process runs under the CPU runtime (slime_ext/cpu_runtime, a test and rehearsal
  aid): slime's engines are the SGLang stand-in engine;
- the work: a few trajectories (2 tasks x up to 2 samples, at most 3 turns of 48 tokens),
  2 rollouts, a checkpoint after each; the tasks file's first rows when it is readable
  here, else synthetic tasks of the harness (mini-SWE or arithmetic TIR);
- W&B disabled, its own run directory (never the config's run_dir).

The report (launch/rehearsal_report.py) comes from the plan's steps (which ran, which
failed) and the job's own output (slime's perf lines and ours).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import random
import secrets
import shlex
import shutil
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from launch.plan import Hosts, Step, hosts_from_config, is_ray_start
from slime_ext.cpu_runtime import ENV_FLAG
from slime_ext.job.config import RECIPES_WITH_TEACHER, JobConfig, config_from_dict
from slime_ext.job.sequence_layout import resolve as resolve_layout
from slime_ext.job.slime_flags import CPU_TREE_SPEC

ROLLOUTS = 2
TASKS = 2
SAMPLES = 2
TURNS = 3
NEW_TOKENS = 48
CONTEXT = {"swe": 2048, "tir": 512}
"""The rehearsal's context budget per harness: a mini-SWE task's prompt and a few turns."""
HEAD_CPUS = 12
"""The head's Ray CPUs: slime asks one per GPU bundle and one per helper actor (the
rollout manager, the engine, the router's), beyond this host's cores."""
FIRST_ADDRESS = 40
"""Nodes go on 127.0.0.40 and up (127.0.0.1 is rewritten by Ray to the host's address)."""
STUDENT_PRESET, TEACHER_PRESET = "qwen3-tiny", "qwen3-small"
CUDA_ONLY_FLAGS = {
    "--use-precision-aware-optimizer": 0,  # Megatron asks Transformer Engine's version
    "--optimizer-cpu-offload": 0,  # with the next, CUDA streams moving Adam states
    "--overlap-cpu-optimizer-d2h-h2d": 0,
    "--recompute-granularity": 1,  # activation recompute saves and restores CUDA RNG state
    "--recompute-method": 1,
    "--recompute-num-layers": 1,
}
"""slime/Megatron options that cannot run under the CPU runtime, each with its number of
values."""
MARKER = ".opd-rehearsal"
"""Marks a directory as a rehearsal's (its run/ and save/ are cleared when used again)."""
Where = Literal["here", "nodes"]


class RehearsalError(RuntimeError):
    """The rehearsal cannot be prepared here (what is missing and its fix)."""


@dataclass
class Rehearsal:
    user: JobConfig
    """The user's config, as given."""
    job: JobConfig
    """The rehearsal's: what runs."""
    hosts: Hosts
    names: dict[str, str]
    """A rehearsal address -> the config's node it stands for."""
    directory: Path
    notes: list[str] = field(default_factory=list)
    """Each thing that differs from the user's job, with why."""
    api_key: str | None = None
    """The teacher key the rehearsal made, when the config's variable is unset here."""
    on: Where = "here"

    @property
    def log_dir(self) -> Path:
        return Path(self.job.logging.run_dir) / "logs"


def prepare(user: JobConfig, directory: Path, on: Where = "here") -> Rehearsal:
    """The rehearsal's models, tasks and job config in `directory` (created; on the
    nodes, a path every node sees). A directory a rehearsal used before is used again:
    its models kept, its run and checkpoints cleared (the job would resume from them); any
    other non-empty directory is refused."""
    _claim(directory)
    notes: list[str] = []
    # here everything runs under the CPU runtime; on the nodes where the job's own
    # environment carries it (nodes without GPUs, as in this project's tests)
    cpu = on == "here" or user.cluster.env.get(ENV_FLAG) == "1"
    if on == "here":
        slime, megatron = _checkouts()
    student_dir, teacher_dir = _models(user, directory, notes)
    layout = resolve_layout(user)
    tasks_file = _tasks(user, directory, notes)
    hosts, names = _addresses(user) if on == "here" else _nodes(user, notes)
    model_args = directory / "model_args.sh"
    args = _model_args(student_dir, cpu)
    model_args.write_text(f"MODEL_ARGS=({shlex.join(args)})\n")

    data = user.model_dump(mode="json")
    harness = user.rollout.harness
    data["model"] |= {"student": str(student_dir), "tokenizer": None}
    parallel = user.parallel
    data["parallel"] = {
        "num_nodes": 1,
        "gpus_per_node": 1 if parallel.colocate else 2,
        "max_tokens_per_gpu": CONTEXT[harness] + NEW_TOKENS,
        "colocate": parallel.colocate,
        **({} if parallel.colocate else {"rollout_gpus": 1}),
    }
    if parallel.num_experts:
        notes.append(
            f"parallel.num_experts {parallel.num_experts} (EP {parallel.ep}): the tiny "
            "student is dense; expert parallelism is not rehearsed"
        )
    if parallel.world_size > 1 or parallel.rollout_gpus:
        notes.append(
            f"parallel: {_layout_text(user)} needs {parallel.world_size} GPUs; here one "
            f"training node with one {'fake ' if cpu else ''}GPU (TP = CP = PP = 1)"
            + ("" if parallel.colocate else " and one for the engine")
            + ": the layout is not rehearsed here"
        )
    data["rollout"] |= {
        "max_turns": min(user.rollout.max_turns, TURNS),
        "max_new_tokens": min(user.rollout.max_new_tokens, NEW_TOKENS),
        "max_context_tokens": min(user.rollout.max_context_tokens, CONTEXT[harness]),
        "tasks_per_step": TASKS,
        "samples_per_task": min(user.rollout.samples_per_task, SAMPLES),
        "concurrency": min(user.rollout.concurrency, TASKS * SAMPLES),
    }
    data["sandbox"] |= {
        "command_timeout_s": min(user.sandbox.command_timeout_s, 30),
        "max_sandboxes": min(user.sandbox.max_sandboxes, TASKS * SAMPLES),
        "warm_per_image": 0,
    }
    synthetic = any(note.startswith("cluster.tasks_file") for note in notes)
    if harness == "swe" and user.sandbox.backend != "local" and (on == "here" or synthetic):
        data["sandbox"]["backend"] = "local"
        why = "here" if on == "here" else "(the synthetic mini-SWE tasks name no image)"
        notes.append(
            f"sandbox.backend {user.sandbox.backend}: rehearsed with local sandboxes "
            f"(bubblewrap) on the sandbox hosts; your task images are not started {why}"
        )
    data["algorithm"] |= {"steps": ROLLOUTS, "sequence_layout": layout.layout}
    data["logging"] |= {
        "run_dir": str(directory / "run"),
        "wandb_mode": "disabled",
        "save_every_steps": 1,
    }
    if user.logging.wandb_mode != "disabled":
        notes.append(f"logging.wandb_mode {user.logging.wandb_mode}: disabled here")
    data["teacher"] = _teacher(user, hosts, student_dir, teacher_dir, notes, on)
    rehearsal_paths = {
        "workers": [],
        "model_args_script": str(model_args),
        "megatron_checkpoint": str(directory / "torch_dist"),
        "save_dir": str(directory / "save"),
        "tasks_file": str(tasks_file),
        "extra_train_args": [
            *(_without_cuda_flags(user, notes) if on == "here" else user.cluster.extra_train_args),
            *(_cpu_train_args(layout.layout) if cpu else ()),
        ],
        "ray_wait_s": min(user.cluster.ray_wait_s, 180),
    }
    if on == "nodes":
        data["cluster"] |= rehearsal_paths
        if user.parallel.num_nodes > 1:
            notes.append(
                f"cluster.workers: {', '.join(user.cluster.workers)} checked reachable, not "
                "started (the rehearsal trains on the head)"
            )
        return _finish(user, config_from_dict(data), hosts, names, directory, notes, on)
    venv = Path(sys.executable).parent
    env = _cpu_env(slime, megatron)
    data["cluster"] |= rehearsal_paths | {
        "executor": "local",
        "head": hosts.head,
        "workers": [],
        "sandbox_hosts": list(hosts.sandbox),
        # this interpreter's environment, not a login shell's (bash -l resets PATH)
        # and the CPU runtime in every process a step starts (the conversion's too)
        "remote_shell": [
            "env",
            f"PATH={venv}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            *(f"{key}={value}" for key, value in env.items()),
            "bash",
            "--norc",
            "--noprofile",
            "-c",
        ],
        "slime_dir": str(slime),
        "megatron_dir": str(megatron),
        "env": {**user.cluster.env, **env},
    }
    return _finish(user, config_from_dict(data), hosts, names, directory, notes, on)


def _finish(
    user: JobConfig,
    job: JobConfig,
    hosts: Hosts,
    names: dict[str, str],
    directory: Path,
    notes: list[str],
    on: Where,
) -> Rehearsal:
    api_key = None
    name = job.teacher.api_key_env
    if on == "here" and name and not os.environ.get(name) and job.teacher.kind != "embedded":
        api_key = secrets.token_urlsafe(24)
        notes.append(f"teacher.api_key_env: {name} is unset here; the rehearsal made a key")
    return Rehearsal(user, job, hosts, names, directory, notes, api_key, on)


def _claim(directory: Path) -> None:
    marker = directory / MARKER
    if directory.is_dir() and not marker.exists() and any(directory.iterdir()):
        raise RehearsalError(
            f"{directory} is not empty and no rehearsal's: a rehearsal clears its run and "
            "checkpoints there; choose another --rehearse-dir (or an empty one)"
        )
    directory.mkdir(parents=True, exist_ok=True)
    marker.write_text("a directory `opd launch --rehearse` made; it clears run/ and save/\n")
    for products in ("run", "save"):
        shutil.rmtree(directory / products, ignore_errors=True)


RAY_PORTS_ENV = "OPD_REHEARSAL_RAY_PORTS"
"""The first of the 1000 ports the rehearsal's Ray nodes take (node i: from it + 100 i);
by default a block of 21000-29999 drawn at random."""


def place_here(steps: list[Step], rehearsal: Rehearsal) -> list[Step]:
    """The plan's steps with each Ray node on its own temp dir and port block (several Ray
    nodes on one host, REFERENCE.md) and the head's fake-GPU node given its CPUs."""
    temp = Path(f"/tmp/opd-rh-{os.getpid()}")  # short: Ray's socket paths hold 107 bytes
    # below Linux's ephemeral range (32768-): no outgoing connection takes a node's port;
    # OPD_REHEARSAL_RAY_PORTS names the block where several rehearsals share a host; not
    # 20000-20999, where slime's training actors draw their MASTER_PORT
    base = int(os.environ.get(RAY_PORTS_ENV) or random.Random().randrange(21000, 30000, 1000))
    placed = []
    for step in steps:
        if is_ray_start(step.command):
            index = int(step.host.rsplit(".", 1)[1]) - FIRST_ADDRESS
            port = base + index * 100
            extra = [
                f"--temp-dir={temp}/{index}",
                f"--node-manager-port={port}",
                f"--object-manager-port={port + 1}",
                f"--metrics-export-port={port + 2}",
                f"--dashboard-agent-listen-port={port + 3}",
                f"--dashboard-agent-grpc-port={port + 4}",
                f"--runtime-env-agent-port={port + 5}",
                f"--min-worker-port={port + 10}",
                f"--max-worker-port={port + 99}",
            ]
            if step.host not in rehearsal.hosts.sandbox:  # those keep their --num-cpus 0
                extra.append(f"--num-cpus={HEAD_CPUS}")
            step = dataclasses.replace(step, command=f"{step.command} {shlex.join(extra)}")
        placed.append(step)
    return placed


def wanted_ports(rehearsal: Rehearsal) -> list[tuple[str, str, int]]:
    """(component, host, port) a daemon of the plan will listen on: the teacher's on its
    node, Ray's and its dashboard's on the head."""
    job, hosts = rehearsal.job, rehearsal.hosts
    wanted = []
    if hosts.teacher is not None:
        wanted.append(("teacher", hosts.teacher, job.teacher.port))
    wanted += [
        ("Ray head", hosts.head, job.cluster.ray_port),
        ("Ray head", hosts.head, job.cluster.dashboard_port),
    ]
    return wanted


def port_problems(rehearsal: Rehearsal) -> list[tuple[str, str]]:
    """(component, why) for each port of `wanted_ports` that something here already holds."""
    problems = []
    for component, address, port in wanted_ports(rehearsal):
        with socket.socket() as probe:
            # as servers bind: a port whose old connections wait out TIME_WAIT is free
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((address, port))
            except OSError as err:
                node = rehearsal.names.get(address, address)
                problems.append(
                    (
                        component,
                        f"port {port} on {node} (here {address}) is taken: {err.strerror}. "
                        "Stop what holds it, or set another port in the config",
                    )
                )
    return problems


def _checkouts() -> tuple[Path, Path]:
    """slime's and Megatron-LM's checkouts installed here (`make slime`)."""
    found = {}
    for name in ("slime", "megatron.training"):
        try:
            spec = importlib.util.find_spec(name)  # found, not imported (Megatron is slow)
        except ImportError:
            spec = None
        if spec is None or spec.origin is None:
            raise RehearsalError(
                f"{name} is not installed here (slime and Megatron-LM's training package): "
                "run `make slime`"
            )
        found[name] = Path(spec.origin).resolve()
    return found["slime"].parents[1], found["megatron.training"].parents[2]


def _models(user: JobConfig, directory: Path, notes: list[str]) -> tuple[Path, Path]:
    from slime_ext.models.factory import build_checkpoint

    student_type = _model_type(user.model.student)
    if student_type == "qwen3":
        notes.append(f"student {user.model.student}: the factory's tiny Qwen3 (its architecture)")
    else:
        seen = f"a {student_type} model" if student_type else "not readable here"
        notes.append(
            f"student {user.model.student} ({seen}): the factory's tiny Qwen3, the nearest "
            "architecture the rehearsal builds (and the CPU runtime trains)"
        )
    student = directory / "student"
    if not (student / "config.json").is_file():
        build_checkpoint(STUDENT_PRESET, student, seed=3)
    teacher = directory / "teacher"
    if not (teacher / "config.json").is_file():
        build_checkpoint(TEACHER_PRESET, teacher, seed=1)
    if user.teacher.kind == "remote" and user.teacher.model:
        notes.append(
            f"teacher {user.teacher.model}: the factory's {TEACHER_PRESET} (the student's "
            "tokenizer, twice its depth)"
        )
    return student, teacher


def _model_type(path: str) -> str | None:
    try:
        return str(json.loads(Path(path, "config.json").read_text()).get("model_type"))
    except (OSError, ValueError):
        return None


def _model_args(student: Path, cpu: bool) -> list[str]:
    """MODEL_ARGS as slime's scripts/models/qwen3-*.sh define them; under the CPU runtime
    with its Megatron settings and layer spec (the conversion step sources them too)."""
    from slime_ext.cpu_runtime import MEGATRON_FLAGS
    from slime_ext.models.megatron_args import qwen3_model_args

    args = qwen3_model_args(student)
    # the plain spec: the conversion sources these too, and the tree attention adds no
    # parameter (the train command's own --spec, _cpu_train_args, puts it in)
    return [*args, *MEGATRON_FLAGS, *_cpu_spec("per_turn")] if cpu else args


def _cpu_spec(layout: str) -> list[str]:
    spec = "tree_layer_spec" if layout == "packed" else "layer_spec"
    return ["--spec", CPU_TREE_SPEC, spec]


def _without_cuda_flags(user: JobConfig, notes: list[str]) -> list[str]:
    """The config's extra train arguments but those that need CUDA (CUDA_ONLY_FLAGS)."""
    kept: list[str] = []
    dropped: list[str] = []
    args = iter(user.cluster.extra_train_args)
    for arg in args:
        if arg in CUDA_ONLY_FLAGS:
            dropped += [arg, *(next(args, "") for _ in range(CUDA_ONLY_FLAGS[arg]))]
        else:
            kept.append(arg)
    if dropped:
        notes.append(
            f"cluster.extra_train_args {' '.join(dropped)}: left out here (they need "
            "Transformer Engine, CUDA streams or CUDA's RNG state)"
        )
    return kept


def _cpu_train_args(layout: str) -> list[str]:
    """After the plan's own arguments: the CPU runtime's (its layer spec in place of the
    plan's tree attention, no train offload) and an optimizer Megatron-LM accepts here."""
    from slime_ext.cpu_runtime import SLIME_FLAGS

    optimizer = ["--adam-beta1", "0.9", "--adam-beta2", "0.999", "--adam-eps", "1e-8"]
    return [*SLIME_FLAGS, *_cpu_spec(layout), *optimizer]


def _cpu_env(slime: Path, megatron: Path) -> dict[str, str]:
    from slime_ext.cpu_runtime import runtime_env_vars

    env = runtime_env_vars(str(slime))
    env["PYTHONPATH"] += f":{megatron}"
    return env | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _tasks(user: JobConfig, directory: Path, notes: list[str]) -> Path:
    """The tasks file's first rows when readable here, else synthetic tasks."""
    out = directory / "tasks.jsonl"
    wanted = TASKS * ROLLOUTS
    source = user.cluster.tasks_file
    if source and user.algorithm.recipe not in ("sft", "ssd"):
        try:
            with open(source) as rows:
                lines = [line for line, _ in zip(rows, range(wanted), strict=False)]
        except OSError as err:
            notes.append(f"cluster.tasks_file {source}: {err.strerror}; synthetic tasks here")
        else:
            if len(lines) < wanted:
                raise RehearsalError(
                    f"cluster.tasks_file {source} has {len(lines)} row(s); a rehearsal "
                    f"takes {wanted}"
                )
            out.write_text("".join(line if line.endswith("\n") else line + "\n" for line in lines))
            return out
    out.write_text("".join(json.dumps(row) + "\n" for row in synthetic_rows(user, wanted)))
    return out


def synthetic_rows(user: JobConfig, count: int) -> list[dict[str, Any]]:
    """`count` task rows for slime's --prompt-data of the job's harness."""
    if user.algorithm.recipe in ("sft", "ssd"):
        raise RehearsalError(
            f"algorithm.recipe {user.algorithm.recipe} trains on pre-tokenized records; a "
            "rehearsal of it is not supported (rehearse the job that collects them)"
        )
    if user.rollout.harness == "swe":
        from rollout.tasks.mini_swe import generate_tasks

        return [
            {"prompt": task.prompt, "label": None, "metadata": {"task": task.model_dump()}}
            for task in generate_tasks(count, seed=5)
        ]
    from rollout.tasks.arithmetic import make_tasks

    return [
        {"prompt": task.prompt, "label": task.answer, "metadata": {}}
        for task in make_tasks(count, "train", seed=0)
    ]


def _addresses(user: JobConfig) -> tuple[Hosts, dict[str, str]]:
    """A loopback address for the head, the teacher's node and each sandbox host."""
    cluster = user.cluster
    head = cluster.head or "the head node"
    teacher = _teacher_node(user)
    roles = [head, *([teacher] if teacher else []), *cluster.sandbox_hosts]
    names = {f"127.0.0.{FIRST_ADDRESS + i}": name for i, name in enumerate(roles)}
    addresses = list(names)
    hosts = Hosts(
        addresses[0],
        [],
        addresses[1] if teacher else None,
        addresses[1 + bool(teacher) :],
    )
    return hosts, names


def _teacher_node(user: JobConfig) -> str | None:
    """The node the rehearsal's teacher service runs on, as the config names it: its own
    node, or for a service the user runs elsewhere (a URL) a stand-in of that service (a
    tiny teacher must share the tiny student's tokenizer)."""
    teacher = user.teacher
    if teacher.kind == "embedded" or user.algorithm.recipe not in RECIPES_WITH_TEACHER:
        return None
    return teacher.node or f"the teacher at {teacher.url}"


def _nodes(user: JobConfig, notes: list[str]) -> tuple[Hosts, dict[str, str]]:
    """The config's own nodes: the head trains, the teacher's node serves (the head when
    the config's teacher is a service elsewhere), the sandbox hosts host."""
    hosts = hosts_from_config(user)
    teacher = None
    if _teacher_node(user) is not None:
        teacher = hosts.teacher or hosts.head
        if hosts.teacher is None:
            notes.append(
                f"teacher.url {user.teacher.url}: the rehearsal's tiny teacher is served on "
                f"{hosts.head} (it must share the tiny student's tokenizer)"
            )
    names = {host: host for host in [hosts.head, *hosts.sandbox, *([teacher] if teacher else [])]}
    return Hosts(hosts.head, [], teacher, list(hosts.sandbox)), names


def _teacher(
    user: JobConfig, hosts: Hosts, student: Path, model: Path, notes: list[str], on: Where
) -> dict[str, Any]:
    teacher = user.teacher.model_dump(mode="json")
    if user.teacher.kind == "embedded":
        return teacher
    # kind self: the frozen snapshot is the (rehearsal's) student
    teacher["model"] = str(model if user.teacher.kind == "remote" else student)
    teacher["hint_max_new_tokens"] = min(user.teacher.hint_max_new_tokens, NEW_TOKENS)
    teacher["hint_attempt_tokens"] = min(user.teacher.hint_attempt_tokens, 512)
    if hosts.teacher is None:  # no teacher in this recipe
        return teacher
    if user.teacher.tp > 1:
        notes.append(f"teacher.tp {user.teacher.tp}: 1 for the tiny teacher")
    if on == "nodes":
        return teacher | {"tp": 1, "node": hosts.teacher, "url": None}
    if user.teacher.backend == "sglang":
        notes.append("teacher.backend sglang: the HF backend here (SGLang needs CUDA)")
    # the plan's own flags first; these after them win (the last value of an option)
    here = ["--device", "cpu", "--dtype", "float32", "--host", hosts.teacher]
    teacher |= {
        "backend": "hf",
        "tp": 1,
        "node": hosts.teacher,
        "url": None,
        "serve_args": [*user.teacher.serve_args, *here],
    }
    return teacher


def _layout_text(user: JobConfig) -> str:
    p = user.parallel
    return (
        f"{p.num_nodes} node(s) x {p.gpus_per_node} GPU(s), TP {p.tp} x CP {p.cp} x "
        f"PP {p.pp} x DP {p.data_parallel}"
    )
