"""A cluster job as an ordered plan of shell commands, each bound to a host.

`opd launch CONFIG --dry-run` prints the plan; `opd launch CONFIG` runs it through an
executor (launch/executor.py); `--sbatch` renders it into a Slurm batch script where the
hosts are the allocation's nodes. The commands follow slime's own launch scripts
(scripts/run-qwen3-4B.sh: ray start, `ray job submit ... -- python3 train.py`) with our
hooks (slime_ext/slime) in place of slime's rollout, reward and loss.

Assumes the run directory (logging.run_dir) is on storage every node sees: the job
config and the hooks' YAML are written there and read by the Ray job.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from launch.shared_paths import check_command
from slime_ext.job.config import (
    OPRD_ON_SLIME,
    RECIPES_WITH_TEACHER,
    ConfigError,
    JobConfig,
    config_to_yaml,
)
from slime_ext.job.sandboxes import describe_sandboxes, hosts_of
from slime_ext.job.sequence_layout import resolve as resolve_layout
from slime_ext.job.slime_flags import (
    SAMPLED_ON_SLIME,
    TOP_P_BELOW_ONE,
    extra_args_problems,
    given_flags,
    router_policy_args,
)
from teacher_server.api import DEFAULT_MAX_TOP_K
from teacher_server.snapshot_sync import converter_problem, slime_converter, snapshot_steps

HOOKS = "slime_ext.slime"
BIND = "OPD_TEACHER_NODE_ADDRESS"
"""Stands for the teacher node's address in its serve command until the host is known."""
SANDBOX_RESOURCE = "opd_sandbox_host"
"""The Ray resource a sandbox host offers (sandbox actors ask for a fraction of it)."""


@dataclass(frozen=True)
class Step:
    name: str
    host: str
    """A host name, or a shell variable ($HEAD) inside a Slurm batch script."""
    command: str
    kind: Literal["run", "background", "wait_http", "write", "check_tokenizer"] = "run"
    """run: must exit 0; background: started and left running (its log in run_dir/logs);
    wait_http: poll `command` (a URL) from here until it answers 200; write: a local file
    at `command` holding `content`; check_tokenizer: compare the service's tokenizer (its
    /v1/info at `command`) with the student's, when the student's is readable here."""
    content: str = ""
    """The file's text for `write` steps."""
    note: str = ""
    """Why the step looks the way it does, printed as a comment with the plan."""
    gpus: bool = False
    """The step uses its node's GPUs (Ray's GPU nodes, the teacher, the conversion): under
    Slurm it requests them; other steps share the node without them."""
    ends_itself: bool = False
    """A background step that finishes on its own (the snapshot sync, after its last
    step). Every other background step is a daemon the job needs: one that ends while a
    later step runs stops the launch (and its teardown runs)."""
    needed: bool = True
    """False: a daemon the job goes on without (a sandbox host: the fleet places the
    sandboxes on the other hosts, and stops the job itself when every rollout of several
    steps in a row fails on its sandboxes); its end is reported, not fatal."""
    restarts: int = 0
    """A daemon that ends before the job itself (the plan's last step) is started: it is
    started again up to this many times, the end of its log reported as the
    reason (a Ray worker's `ray start` times out now and then on a loaded node, and joins
    on the next try)."""


@dataclass(frozen=True)
class Hosts:
    head: str
    workers: list[str] = field(default_factory=list)
    teacher: str | None = None
    sandbox: list[str] = field(default_factory=list)


def hosts_from_config(job: JobConfig) -> Hosts:
    cluster = job.cluster
    if cluster.executor == "local":
        nodes = ["localhost"] * job.parallel.num_nodes
        return Hosts(nodes[0], nodes[1:], "localhost" if job.teacher.node else None, [])
    missing = []
    if cluster.head is None:
        missing.append("cluster.head (the first training node)")
    if len(cluster.workers) != job.parallel.num_nodes - 1:
        missing.append(
            f"cluster.workers: {job.parallel.num_nodes - 1} more training node(s) for "
            f"num_nodes {job.parallel.num_nodes}, got {len(cluster.workers)}"
        )
    if missing:
        raise ConfigError(
            "cannot place the job: "
            + "; ".join(missing)
            + " (`opd launch --sbatch` takes the nodes from the Slurm allocation instead)"
        )
    assert cluster.head is not None
    return Hosts(cluster.head, list(cluster.workers), job.teacher.node, list(cluster.sandbox_hosts))


def check_cluster(job: JobConfig) -> None:
    """What a cluster launch needs beyond a valid config, each with its fix."""
    problems = []
    if job.parallel.gpus_per_node == 0:
        problems.append("parallel.gpus_per_node is 0: a cluster job trains on GPUs")
    if job.cluster.model_args_script is None:
        problems.append(
            "cluster.model_args_script: name slime's scripts/models/<arch>.sh for the "
            "student (it defines the Megatron model arguments)"
        )
    if job.cluster.megatron_checkpoint is None:
        problems.append("cluster.megatron_checkpoint: where the torch_dist student lives")
    if job.cluster.save_dir is None:
        problems.append("cluster.save_dir: where this run's Megatron checkpoints go")
    recipe = job.algorithm.recipe
    if recipe == "oprd" and job.algorithm.oprd_failure_loss == "shared_support":
        problems.append(f"algorithm.oprd_failure_loss: {OPRD_ON_SLIME}")
    if job.cluster.tasks_file is None:
        problems.append(
            "cluster.tasks_file: the pre-tokenized SFT records (slime_ext.sft_data, e.g. from "
            "`opd ssd export`) that slime_ext.slime.sft_rollout feeds"
            if recipe in ("sft", "ssd")
            else "cluster.tasks_file: the training tasks (JSONL) for slime's --prompt-data"
        )
    teacher = job.teacher
    if recipe in RECIPES_WITH_TEACHER:
        if teacher.kind == "self":
            if teacher.node is None and not teacher.url:
                problems.append(
                    "teacher: the self-teacher is the student's snapshot served by opd-teacher: "
                    "set teacher.node (`opd launch` serves teacher.model there, by default "
                    "model.student) or teacher.url (a snapshot service already running)"
                )
            if teacher.snapshot != "fixed":
                problems += _snapshot_sync_problems(job)
        elif teacher.kind != "remote" or not teacher.url:
            problems.append(
                "teacher: a cluster job scores with a standalone service: kind remote and url "
                "(or kind self for recipes opsd and oprd: the student's own snapshot)"
            )
        if teacher.node is not None and teacher.model is None:
            problems.append("teacher.model: the checkpoint `opd launch` serves on teacher.node")
        if not teacher.api_key_env and not teacher.unauthenticated:
            problems.append(
                "teacher.api_key_env: a cluster teacher answers whoever reaches its port: "
                "name the environment variable holding its API key (e.g. "
                "OPD_TEACHER_API_KEY, exported where `opd launch` or `sbatch` runs), or set "
                "teacher.unauthenticated: true to score without one on purpose"
            )
    problems += _sampling_problems(job) + _sandbox_problems(job)
    if job.algorithm.reward_weight > 0:
        problems.append(
            f"algorithm.reward_weight {job.algorithm.reward_weight}: OPD plus outcome reward "
            "trains on the local trainer only (slime's loss gets the teacher's KL or the "
            "reward's advantages, not both yet): set algorithm.reward_weight: 0"
        )
    problems += _layout_problems(job) + _kl_discount_problems(job)
    problems += _gpu_problems(job) + _context_problems(job)
    problems += extra_args_problems(job)
    if problems:
        raise ConfigError("not launchable on a cluster:\n  " + "\n  ".join(problems))


def _layout_problems(job: JobConfig) -> list[str]:
    """The sequence layout the plan resolves (the hooks and Megatron read it from job.yaml):
    a layout asked for that cannot train this recipe or student, reported here as well as
    where the plan is built."""
    try:
        resolve_layout(job)
    except ConfigError as err:
        return [str(err)]
    return []


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _int_flag(args: Sequence[str], flag: str) -> int | None:
    """The last value of `flag` in `args` (`--flag N` or `--flag=N`), when it is a count."""
    value = given_flags(args).get(flag)
    return int(value) if value is not None and value.isdigit() else None


def ray_gpus_per_node(job: JobConfig) -> int:
    """The GPUs Ray offers on each training node: parallel.gpus_per_node, or the last
    `--num-gpus` of cluster.ray_start_args (appended after the plan's: it wins)."""
    given = _int_flag(job.cluster.ray_start_args, "--num-gpus")
    return job.parallel.gpus_per_node if given is None else given


def _gpu_problems(job: JobConfig) -> list[str]:
    """Parallel sizes against the GPUs the job's nodes have: the teacher's SGLang TP within
    its node, and disaggregated rollout engines beside the training GPUs."""
    layout, teacher, problems = job.parallel, job.teacher, []
    gpus = layout.gpus_per_node
    serves_teacher = job.algorithm.recipe in RECIPES_WITH_TEACHER and teacher.node is not None
    if serves_teacher and teacher.backend == "sglang" and gpus and teacher.tp > gpus:
        problems.append(
            f"teacher.tp {teacher.tp}: SGLang's tensor parallelism stays within the teacher's "
            f"node, which has parallel.gpus_per_node {gpus} GPUs (the job's nodes are alike): "
            f"set teacher.tp to one of {_divisors(gpus)}"
        )
    if not layout.colocate and layout.rollout_gpus is not None and gpus:
        per_node = ray_gpus_per_node(job)
        offered = per_node * layout.num_nodes
        wanted = layout.world_size + layout.rollout_gpus
        if offered < wanted:
            problems.append(
                f"parallel.colocate false: the rollout engines' {layout.rollout_gpus} GPUs "
                f"(parallel.rollout_gpus) come on top of the {layout.world_size} training "
                f"GPUs, {wanted} in all, but Ray offers {offered} ({layout.num_nodes} node(s) "
                f"x {per_node}): on nodes with more GPUs than training uses, "
                "add `--num-gpus <the node's GPUs>` to cluster.ray_start_args; or set "
                "parallel.colocate: true"
            )
    engine = layout.rollout_gpus_per_engine or layout.tp
    if not layout.colocate and layout.rollout_gpus and layout.rollout_gpus % engine:
        problems.append(
            f"parallel.rollout_gpus {layout.rollout_gpus} is not a multiple of the GPUs of "
            f"one rollout engine ({engine}, parallel.rollout_gpus_per_engine or tp): set "
            f"rollout_gpus to a multiple of {engine}"
        )
    return problems


def context_budget(job: JobConfig) -> int:
    """The longest sequence a turn makes: its context and its generation."""
    return job.rollout.max_context_tokens + job.rollout.max_new_tokens


def model_context_limit(path: str | None) -> int | None:
    """max_position_embeddings of a HF checkpoint readable here (its text model's, for a
    multimodal config); None where it is not readable or does not say."""
    if not path or not Path(path, "config.json").is_file():
        return None
    try:
        data = json.loads(Path(path, "config.json").read_text())
    except (OSError, ValueError):
        return None
    for section in (data, data.get("text_config") or {}):
        value = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def _context_problems(job: JobConfig) -> list[str]:
    """The context budget against the student's and the teacher's limits where they are
    readable here (config.json's max_position_embeddings, the teacher's --max-context)."""
    budget, problems = context_budget(job), []
    what = (
        f"rollout.max_context_tokens {job.rollout.max_context_tokens} + max_new_tokens "
        f"{job.rollout.max_new_tokens} = {budget}"
    )
    student = model_context_limit(job.model.student)
    if student is not None and budget > student:
        problems.append(
            f"{what} is above the student's max_position_embeddings {student} "
            f"({job.model.student}/config.json): {_fit(job, student)}"
        )
    teacher = job.teacher
    if job.algorithm.recipe not in RECIPES_WITH_TEACHER or teacher.node is None:
        return problems  # a service someone else runs: its /v1/info says, at launch
    limits = [
        (model_context_limit(teacher.model), f"max_position_embeddings ({teacher.model})"),
        (_int_flag(teacher.serve_args, "--max-context"), "--max-context in teacher.serve_args"),
    ]
    for limit, source in limits:
        if limit is not None and budget > limit:
            problems.append(
                f"{what} is above the teacher's {source} {limit}: the service would refuse "
                f"the longest turns (413): {_fit(job, limit)}, or serve the teacher with a "
                "longer context"
            )
    return problems


def _fit(job: JobConfig, limit: int) -> str:
    """The setting that brings the context budget within `limit`."""
    room = limit - job.rollout.max_new_tokens
    if room >= 16:  # rollout.max_context_tokens' own minimum
        return f"lower rollout.max_context_tokens to at most {room}"
    return (
        f"lower rollout.max_new_tokens (now {job.rollout.max_new_tokens}) and "
        f"max_context_tokens so that their sum is at most {limit}"
    )


def _kl_discount_problems(job: JobConfig) -> list[str]:
    """algorithm.kl_discount sums each token's later KL within its sample (slime's loss
    hook): a trajectory must be one sample, whole on one rank."""
    discount = job.algorithm.kl_discount
    if not discount:
        return []
    if job.parallel.cp > 1:
        where = f"parallel.cp {job.parallel.cp} splits a trajectory's tokens over ranks"
    else:
        try:
            layout = resolve_layout(job)
        except ConfigError:
            return []  # _layout_problems reports the layout's own problem
        if layout.layout == "packed":
            return []
        where = (
            f"the layout is per turn ({layout.why}): a turn's sample holds none of the later "
            "turns its tokens would be charged for"
        )
    return [
        f"algorithm.kl_discount {discount} sums each token's later KL within its sample, so a "
        f"trajectory must be one sample on one rank, but {where}: set kl_discount: 0, or "
        "sequence_layout packed with parallel.cp 1"
    ]


def _sandbox_problems(job: JobConfig) -> list[str]:
    """Where a SWE job's sandboxes would start, when nothing offers them."""
    section = job.sandbox
    if job.rollout.harness != "swe" or section.backend == "e2b" or section.fleet_file:
        return []
    if section.hosts == "ray" and not job.cluster.sandbox_hosts:
        return [
            "sandbox.hosts ray: cluster.sandbox_hosts names no node to start the sandbox "
            "hosts on (or set sandbox.hosts: here to run every sandbox on the head)"
        ]
    hosts = len(job.cluster.sandbox_hosts) if hosts_of(job) == "ray" else 1
    if job.rollout.concurrency > section.max_sandboxes * hosts:
        # a trajectory waits for a free sandbox, then aborts at the fleet's acquire timeout
        per_host = -(-job.rollout.concurrency // hosts)
        return [
            f"sandbox.max_sandboxes {section.max_sandboxes}: rollout.concurrency "
            f"{job.rollout.concurrency} trajectories at once need as many sandboxes, and "
            f"{hosts} sandbox host(s) give {section.max_sandboxes * hosts}: set "
            f"sandbox.max_sandboxes: {per_host} (or add sandbox hosts)"
        ]
    return []


def _sampling_problems(job: JobConfig) -> list[str]:
    """Truncated sampling, which slime cannot train on with our per-turn samples."""
    rollout, recipe, problems = job.rollout, job.algorithm.recipe, []
    if recipe not in SAMPLED_ON_SLIME:
        return []  # sft / ssd: pre-tokenized data, the plan passes no top-p / top-k
    if rollout.top_p < 1.0:
        problems.append(f"rollout.top_p {rollout.top_p}: {TOP_P_BELOW_ONE}: set rollout.top_p: 1.0")
    if rollout.top_k != -1:
        problems.append(
            f"rollout.top_k {rollout.top_k}: slime keeps no top-k token sets (only top-p "
            "ones), so its recomputed log-probs and our losses would use the untruncated "
            "distribution of samples drawn from a truncated one: off-policy training without "
            "a warning. Set rollout.top_k: -1"
        )
    return problems


def _snapshot_sync_problems(job: JobConfig) -> list[str]:
    """What `opd-teacher sync` (ema / refresh on a cluster) needs from the config."""
    teacher, problems = job.teacher, []
    what = f"teacher.snapshot '{teacher.snapshot}'"
    if teacher.node is None:
        problems.append(
            f"teacher.node: {what} runs `opd-teacher sync` next to the service it reloads, "
            "on the node `opd launch` starts it on; a service at teacher.url only stays fixed"
        )
    if not teacher.api_key_env:
        problems.append(
            f"teacher.api_key_env: {what} reloads the teacher through its authenticated "
            "/v1/reload: name the environment variable holding the service's API key"
        )
    if not _sync_steps(job):
        setting = "ema_sync_every" if teacher.snapshot == "ema" else "refresh_at"
        problems.append(
            f"teacher.{setting}: no snapshot step before the last of algorithm.steps "
            f"{job.algorithm.steps} (a snapshot after it scores nothing)"
        )
    converter = teacher.snapshot_converter
    if converter is not None and (problem := converter_problem(converter)):
        problems.append(f"teacher.snapshot_converter: {problem}")
    return problems


def _syncs_snapshot(job: JobConfig) -> bool:
    teacher = job.teacher
    recipe_syncs = job.algorithm.recipe in RECIPES_WITH_TEACHER and teacher.kind == "self"
    return recipe_syncs and teacher.snapshot != "fixed"


def _sync_steps(job: JobConfig) -> list[int]:
    teacher = job.teacher
    assert teacher.snapshot != "fixed"
    return snapshot_steps(
        teacher.snapshot, job.algorithm.steps, teacher.refresh_at, teacher.ema_sync_every
    )


def save_interval(job: JobConfig) -> int:
    """slime's --save-interval: logging.save_every_steps, lowered (to the gcd) when the
    snapshot sync needs checkpoints of other steps; slime has one interval."""
    if not _syncs_snapshot(job):
        return job.logging.save_every_steps
    return math.gcd(job.logging.save_every_steps, *_sync_steps(job))


def build_plan(
    job: JobConfig,
    hosts: Hosts,
    run_dir: str | None = None,
    wait_for_job: bool = False,
    allow_changed: Sequence[str] = (),
    submission_id: str | None = None,
) -> list[Step]:
    """The steps in order. wait_for_job: `ray job submit` blocks until the job ends (inside
    a Slurm allocation, whose lifetime is the job's); otherwise it returns once submitted.
    allow_changed: settings a relaunch of the run may change (launch/relaunch.py).
    submission_id: the Ray job's id (shell words, expanded on the head), so a teardown can
    stop the job by it."""
    check_cluster(job)
    layout = resolve_layout(job)  # the hooks read it from job.yaml: they and Megatron agree
    job = job.model_copy(
        update={"algorithm": job.algorithm.model_copy(update={"sequence_layout": layout.layout})}
    )
    if hosts.teacher is not None:  # the service we start is the one the hooks call
        teacher = job.teacher.model_copy(
            update={"url": f"http://{hosts.teacher}:{job.teacher.port}"}
        )
        job = job.model_copy(update={"teacher": teacher})
    cluster = job.cluster
    run = run_dir or str(job.logging.run_dir)
    job_yaml, hooks_yaml = f"{run}/job.yaml", f"{run}/hooks.yaml"
    hooks: dict[str, object] = {"opd_job_config": job_yaml}
    if job.algorithm.recipe in ("sft", "ssd"):
        hooks["opd_sft_data"] = cluster.tasks_file
    written = {job_yaml: config_to_yaml(job), hooks_yaml: yaml.safe_dump(hooks)}
    relaunch = ["python3", "-m", "launch.relaunch", "--run-dir", run]
    for key in allow_changed:
        relaunch += ["--allow-changed", key]
    steps = [
        # beside the run's own job.yaml: a relaunch compares before it replaces it
        Step("write job config", "local", f"{run}/job.next.yaml", "write", written[job_yaml]),
        Step("write hook config", "local", hooks_yaml, "write", written[hooks_yaml]),
        Step(
            "check relaunch",
            hosts.head,
            shlex.join(relaunch),
            note="a run launched again goes on from its newest checkpoint with the same "
            "W&B run; changed settings stop it here unless --allow-changed names them",
        ),
    ]
    for host in [hosts.head, *hosts.workers]:  # nothing is copied: the nodes share them
        steps.append(Step("check shared paths", host, check_command(job, host, written)))
    # the teacher loads (minutes for a large model) while the checkpoint converts and
    # Ray's cluster forms: only the submit needs it answering
    starting, ready = _teacher_steps(job, hosts, run)
    steps += starting
    steps.append(_convert_step(job, hosts))  # before Ray holds the head's GPUs
    steps += _ray_steps(job, hosts)
    steps += ready
    steps.append(_prune_step(job, hosts.head, run))
    submit = _submit_command(job, hooks_yaml, run, wait_for_job, submission_id)
    note = "; ".join(
        n for n in (f"sequence layout {layout.layout}: {layout.why}", _submit_note(job)) if n
    )
    steps.append(Step("submit", hosts.head, submit, note=note))
    return steps


def _prune_step(job: JobConfig, host: str, run: str) -> Step:
    """launch/prune_checkpoints.py beside training: slime's checkpoints in save_dir kept to
    logging.keep_checkpoints (the newest always, and those the snapshot sync still needs)."""
    save, keep = str(job.cluster.save_dir), job.logging.keep_checkpoints
    command = [
        "python3", "-m", "launch.prune_checkpoints", "--save-dir", save, "--keep", str(keep),
    ]  # fmt: skip
    if _syncs_snapshot(job):  # slime saves after step s as iteration s - 1
        protect = ",".join(str(step - 1) for step in _sync_steps(job))
        command += ["--protect", protect, "--sync-state", f"{run}/teacher_sync/state.json"]
    return Step(
        "prune checkpoints",
        host,
        shlex.join(command),
        "background",
        note=f"keeps the newest {keep} of slime's checkpoints in {save} (logging."
        "keep_checkpoints); the job goes on without it",
        needed=False,
    )


def wandb_run_id(job: JobConfig) -> str:
    """The W&B run of a cluster run: the same on every launch of the same run directory and
    project (a relaunch continues it), another for another run."""
    import hashlib

    logging = job.logging
    digest = hashlib.sha256(f"{logging.wandb_project}\0{logging.run_dir}".encode()).hexdigest()
    return f"{slug(logging.run_dir.name)[:40]}-{digest[:8]}"


def _teacher_steps(job: JobConfig, hosts: Hosts, run: str) -> tuple[list[Step], list[Step]]:
    """The teacher service on its node: OPD's teacher model, or for OPSD and OPRD (kind
    self) the student's own initial checkpoint (the frozen snapshot), scored the same way
    (the hint or the reminders are in the contexts the hooks send). Two lists: what starts
    loading the model (run first), and the rest, up to the service answering (run once
    Ray's cluster formed); a teacher served by someone else is all checked first."""
    teacher = job.teacher
    if job.algorithm.recipe not in RECIPES_WITH_TEACHER:
        return [], []
    assert teacher.url is not None
    starting: list[Step] = []
    ready: list[Step] = []
    if hosts.teacher is not None:
        assert teacher.model is not None
        # without a key, only the address the job's nodes use (not every interface);
        # unquoted, as every step names its hosts ($ADDR_i expands in a batch script)
        bind = BIND if teacher.unauthenticated else "0.0.0.0"
        serve = [
            "opd-teacher", "serve", "--backend", teacher.backend, "--model", teacher.model,
            "--host", bind, "--port", str(teacher.port),
        ]  # fmt: skip
        if teacher.backend == "sglang":
            starting.append(
                Step(
                    "teacher sglang",
                    hosts.teacher,
                    f"python3 -m sglang.launch_server --model-path {shlex.quote(teacher.model)} "
                    f"--tp-size {teacher.tp} --host 127.0.0.1 --port 30000",
                    "background",
                    gpus=True,
                )
            )
            ready.append(
                Step("wait teacher sglang", hosts.teacher, _wait("http://127.0.0.1:30000/health"))
            )
            serve += ["--sglang-url", "http://127.0.0.1:30000"]
        else:
            serve += ["--device", "cuda", "--dtype", "bfloat16"]
        if teacher.top_k > DEFAULT_MAX_TOP_K:  # the service refuses a larger top_k (422)
            serve += ["--max-top-k", str(teacher.top_k)]
        serve += teacher.serve_args
        env = ""
        if teacher.api_key_env:
            env = f"env OPD_TEACHER_API_KEY=${{{teacher.api_key_env}}} "
        note = ""
        if teacher.unauthenticated:
            note = (
                f"teacher.unauthenticated: no API key; bound to {hosts.teacher} only, and "
                f"anyone who can reach {hosts.teacher}:{teacher.port} can score with it"
            )
        serving = Step(
            "teacher service",
            hosts.teacher,
            env + shlex.join(serve).replace(BIND, hosts.teacher),
            "background",
            note=note,
            gpus=teacher.backend == "hf",  # with sglang, SGLang holds them
        )
        (ready if teacher.backend == "sglang" else starting).append(serving)
    url = f"http://{hosts.teacher}:{teacher.port}" if hosts.teacher else teacher.url
    ready.append(Step("wait teacher", "local", f"{url.rstrip('/')}/health", "wait_http"))
    ready.append(
        Step("check teacher tokenizer", "local", f"{url.rstrip('/')}/v1/info", "check_tokenizer")
    )
    if hosts.teacher is None:  # served by someone else: nothing loads, check it first
        return ready, []
    if _syncs_snapshot(job):
        ready.append(_sync_step(job, hosts.teacher, run))
    return starting, ready


def _sync_step(job: JobConfig, host: str, run: str) -> Step:
    """`opd-teacher sync` beside the service: slime's checkpoints of the snapshot steps,
    converted to HF on the teacher node, reloaded into the service (ema: averaged first)."""
    teacher, cluster = job.teacher, job.cluster
    assert teacher.model is not None and cluster.save_dir is not None
    converter = teacher.snapshot_converter or slime_converter(
        cluster.slime_dir, cluster.megatron_dir
    )
    sync = [
        "opd-teacher", "sync", "--mode", teacher.snapshot,
        "--teacher-url", f"http://127.0.0.1:{teacher.port}",
        "--save-dir", cluster.save_dir, "--work-dir", f"{run}/teacher_sync",
        "--origin-hf-dir", teacher.model, "--steps", str(job.algorithm.steps),
    ]  # fmt: skip
    if teacher.snapshot == "refresh":
        for fraction in teacher.refresh_at:
            sync += ["--refresh-at", str(fraction)]
    else:
        sync += ["--ema-decay", str(teacher.ema_decay), "--ema-every", str(teacher.ema_sync_every)]
    sync += ["--converter", converter]
    env = f"env OPD_TEACHER_API_KEY=${{{teacher.api_key_env}}} "
    steps = _sync_steps(job)
    which = (
        f"the average of the checkpoints saved every {teacher.ema_sync_every} steps (an EMA "
        "over checkpoints)"
        if teacher.snapshot == "ema"
        else f"the checkpoints of steps {', '.join(map(str, steps))}"
    )
    note = f"reloads the teacher with {which}; exits after step {steps[-1]}"
    return Step(
        "teacher snapshot sync",
        host,
        env + shlex.join(sync),
        "background",
        note=note,
        ends_itself=True,
    )


def _submit_note(job: JobConfig) -> str:
    rollout, notes = job.rollout, [_save_interval_note(job)]
    if rollout.harness == "swe":
        where = describe_sandboxes(job.sandbox, hosts_of(job), on_cluster=True)
        notes.append(f"SWE sandboxes: {where}")
    if job.algorithm.recipe in ("sft", "ssd") and rollout.samples_per_task > 1:
        trajectories = rollout.tasks_per_step * rollout.samples_per_task
        notes.append(
            f"--rollout-batch-size {trajectories} counts trajectories (rollout.tasks_per_step "
            f"{rollout.tasks_per_step} x samples_per_task {rollout.samples_per_task}): "
            "slime_ext.slime.sft_rollout emits one per group"
        )
    return "; ".join(note for note in notes if note)


def _save_interval_note(job: JobConfig) -> str:
    if not _syncs_snapshot(job):
        return ""
    interval, configured = save_interval(job), job.logging.save_every_steps
    lowered = (
        f"lowered from logging.save_every_steps {configured} " if interval != configured else ""
    )
    return (
        f"--save-interval {interval} {lowered}so that every step the teacher snapshot sync "
        "needs is a save step"
    )


def check_teacher_command(job: JobConfig, info_url: str) -> str:
    """The batch script's check that the teacher at `info_url` tokenizes as the student
    (launch/check_teacher.py; `opd launch` runs the same comparison in-process)."""
    url = "".join("\\" + c if c in '"\\`' else c for c in info_url)  # $ADDR_i expands
    command = ["--student", job.model.tokenizer or job.model.student]
    command += ["--context-budget", str(context_budget(job))]
    if job.teacher.api_key_env:
        command += ["--api-key-env", job.teacher.api_key_env]
    return f'python3 -m launch.check_teacher --info-url "{url}" {shlex.join(command)}'


def _wait(url: str, timeout_s: int = 1800) -> str:
    """A command that returns once `url` answers (SGLang loads a large model for minutes)."""
    loop = f"until curl -sf {url} >/dev/null; do sleep 1; done"
    return f"timeout {timeout_s} bash -c {shlex.quote(loop)}"


def _convert_step(job: JobConfig, hosts: Hosts) -> Step:
    """HF -> Megatron torch_dist, skipped when the checkpoint is there already; with the
    job's `cluster.env`, as its Ray job has it (a PYTHONPATH there after Megatron-LM's)."""
    cluster = job.cluster
    target = shlex.quote(str(cluster.megatron_checkpoint))
    env = dict(cluster.env)
    path = ":".join(p for p in (cluster.megatron_dir, env.pop("PYTHONPATH", "")) if p)
    assignments = "".join(f"{name}={shlex.quote(value)} " for name, value in env.items())
    convert = (
        # the node's own PYTHONPATH kept last (its plugins, a site dir)
        f"{_in_slime(job)} && {assignments}PYTHONPATH={shlex.quote(path)}"
        "${PYTHONPATH:+:$PYTHONPATH} torchrun "
        f"--nproc-per-node {job.parallel.gpus_per_node} tools/convert_hf_to_torch_dist.py "
        '"${MODEL_ARGS[@]}" '
        f"--hf-checkpoint {shlex.quote(job.model.student)} --save {target}"
    )
    return Step(
        "convert checkpoint",
        hosts.head,
        f"test -f {target}/latest_checkpointed_iteration.txt || ({convert})",
        gpus=True,
    )


def train_args(job: JobConfig, hooks_yaml: str) -> list[str]:
    """slime's train.py arguments after "${MODEL_ARGS[@]}"."""
    layout, rollout, algorithm, cluster = job.parallel, job.rollout, job.algorithm, job.cluster
    args = [
        "--actor-num-nodes", str(layout.num_nodes),
        "--actor-num-gpus-per-node", str(layout.gpus_per_node),
        "--rollout-num-gpus-per-engine", str(layout.rollout_gpus_per_engine or layout.tp),
    ]  # fmt: skip
    if layout.colocate:
        args.append("--colocate")
    else:
        args += ["--rollout-num-gpus", str(layout.rollout_gpus)]
    args += [
        "--hf-checkpoint", job.model.student,
        "--ref-load", str(cluster.megatron_checkpoint),
        "--load", str(cluster.save_dir),
        "--save", str(cluster.save_dir),
        "--save-interval", str(save_interval(job)),
        "--tensor-model-parallel-size", str(layout.tp),
        "--context-parallel-size", str(layout.cp),
        "--pipeline-model-parallel-size", str(layout.pp),
        "--expert-model-parallel-size", str(layout.ep),
        "--expert-tensor-parallel-size", str(layout.etp),
        "--use-dynamic-batch-size",
        "--max-tokens-per-gpu", str(layout.max_tokens_per_gpu),
    ]  # fmt: skip
    if layout.tp > 1:
        args.append("--sequence-parallel")
    trajectories = rollout.tasks_per_step * rollout.samples_per_task
    pretokenized = algorithm.recipe in ("sft", "ssd")
    args += ["--num-rollout", str(algorithm.steps)]
    if pretokenized:  # sft_rollout emits rollout_batch_size trajectories, one per group
        args += ["--rollout-batch-size", str(trajectories), "--n-samples-per-prompt", "1"]
    else:
        args += [
            "--rollout-batch-size", str(rollout.tasks_per_step),
            "--n-samples-per-prompt", str(rollout.samples_per_task),
        ]  # fmt: skip
    args += [
        "--global-batch-size", str(trajectories),
        "--rollout-max-response-len", str(rollout.max_new_tokens),
        "--rollout-temperature", str(rollout.temperature),
    ]  # fmt: skip
    if not pretokenized:  # slime samples nothing for sft / ssd
        args += ["--rollout-top-p", str(rollout.top_p), "--rollout-top-k", str(rollout.top_k)]
    decaying = algorithm.lr_schedule != "constant"
    packed = algorithm.sequence_layout == "packed"
    # the teacher's top-k and the packed samples' trees ride slime's data path (tree.init
    # installs both extensions on every Megatron rank)
    extends_data = job.needs_teacher_topk or packed
    if packed:  # the tree attention in every layer, RoPE moved into it
        args += [
            "--spec", f"{HOOKS}.tree_attention", "layer_spec",
            "--position-embedding-type", "none",
        ]  # fmt: skip
    args += [
        "--custom-config-path", hooks_yaml,
        "--loss-type", "custom_loss",
        "--custom-loss-function-path", f"{HOOKS}.loss.loss",
        "--custom-rollout-log-function-path", f"{HOOKS}.metrics.log_rollout",
        *(["--custom-megatron-init-path", f"{HOOKS}.tree.init"] if extends_data else []),
        "--optimizer", "adam",
        # Megatron's iterations are optimizer steps, one per rollout: --global-batch-size is
        # the rollout's trajectories (slime steps per global_batch_size rollouts)
        "--lr", str(algorithm.lr),
        "--lr-decay-style", algorithm.lr_schedule,
        "--lr-warmup-iters", str(algorithm.lr_warmup_steps),
        "--min-lr", str(algorithm.min_lr),
        *(["--lr-decay-iters", str(algorithm.steps)] if decaying else []),
        "--weight-decay", str(algorithm.weight_decay),
        "--clip-grad", str(algorithm.grad_clip),
        "--attention-dropout", "0.0",
        "--hidden-dropout", "0.0",
        "--accumulate-allreduce-grads-in-fp32",
        "--attention-softmax-in-fp32",
    ]  # fmt: skip
    if pretokenized:
        args += [
            "--rollout-function-path", f"{HOOKS}.sft_rollout.generate_rollout",
            "--disable-compute-advantages-and-returns",
        ]  # fmt: skip
    else:
        # OPRD: each trajectory's branch reaches the loss in advantages (slime_ext/slime/oprd.py)
        oprd = algorithm.recipe == "oprd"
        post_process = f"{HOOKS}.oprd" if oprd else f"{HOOKS}.reward"
        args += [
            "--prompt-data", str(cluster.tasks_file),
            "--input-key", "prompt",
            "--label-key", "label",
            "--metadata-key", "metadata",
            "--rollout-shuffle",
            "--custom-generate-function-path", f"{HOOKS}.generate.generate",
            "--custom-rm-path", f"{HOOKS}.reward.reward",
            "--custom-reward-post-process-path", f"{post_process}.post_process_rewards",
            "--advantage-estimator", "grpo",
        ]  # fmt: skip
        if oprd:
            args += ["--custom-advantage-function-path", f"{HOOKS}.oprd.advantages"]
        args += router_policy_args(job)  # trajectories stay on one engine's prefix cache
    logging = job.logging
    if logging.wandb_mode != "disabled":
        # slime names its run after the group (a missing group crashed train.py at start,
        # wandb_utils.py:46), by default with a random suffix from wandb.util.generate_id,
        # which wandb 0.2x removed; offline runs land in its cwd (slime's checkout) unless
        # given a directory
        args += [
            "--use-wandb", "--wandb-project", logging.wandb_project,
            "--wandb-mode", logging.wandb_mode,
            "--wandb-group", logging.wandb_group or logging.run_dir.name,
            "--disable-wandb-random-suffix",
            "--wandb-dir", str(logging.run_dir / "wandb"),
        ]  # fmt: skip
        if logging.wandb_entity:
            args += ["--wandb-team", logging.wandb_entity]
    return args + list(cluster.extra_train_args)


RAY_JOIN_RESTARTS = 3
"""How often a node's `ray start --address` that ends before the job starts is run again
(the head's is not: the nodes joined to it would be lost with it). Ray gives a node 30 s
to register (not configurable): on a loaded machine a start timed out twice and joined on
its third try."""


RAY_START = "env RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0 ray start --block"
"""How every node's Ray starts: a daemon that lives as long as its step, its processes
stopped at once on SIGTERM. Ray (2.60 here) otherwise drains a node on SIGTERM for up to
30 s, waiting for its leases to come back: a head whose job still runs never gets them
back, so every stop of a failed launch waited the 30 s out, and under Slurm (KillWait)
or past the executor's grace the SIGKILL landed mid-shutdown. The launch stops a node only
once its job is over or failed: there is nothing to drain for."""


def is_ray_start(command: str) -> bool:
    """Whether a step's command starts a node's Ray (`RAY_START`)."""
    return command.startswith(RAY_START)


def _ray_steps(job: JobConfig, hosts: Hosts) -> list[Step]:
    """Ray on every node, each `ray start --block` as a daemon step (it lives as long as
    the step, and its processes end with it), the head waited for before the others join
    and the whole cluster before anything is submitted."""
    cluster, gpus = job.cluster, job.parallel.gpus_per_node
    address = f"{hosts.head}:{cluster.ray_port}"
    extra = f" {' '.join(cluster.ray_start_args)}" if cluster.ray_start_args else ""
    wait = f"python3 -m launch.wait_ray --address {address} --timeout-s {cluster.ray_wait_s}"
    steps = [
        Step(
            "ray head",
            hosts.head,
            f"{RAY_START} --head --node-ip-address {hosts.head} --port {cluster.ray_port} "
            f"--num-gpus {gpus} --disable-usage-stats --dashboard-host 0.0.0.0 "
            f"--dashboard-port {cluster.dashboard_port}{extra}",
            "background",
            gpus=gpus > 0,
        ),
        Step("wait ray head", hosts.head, f"{wait} --nodes 1"),
    ]
    for index, worker in enumerate(hosts.workers, start=1):
        steps.append(
            Step(
                f"ray worker {index}",
                worker,
                f"{RAY_START} --address {address} --node-ip-address {worker} "
                f"--num-gpus {gpus} --disable-usage-stats{extra}",
                "background",
                gpus=gpus > 0,
                restarts=RAY_JOIN_RESTARTS,
            )
        )
    for index, host in enumerate(hosts.sandbox):
        resources = shlex.quote(json.dumps({SANDBOX_RESOURCE: 1}))
        steps.append(
            Step(
                f"sandbox host {index}",
                host,
                # no CPUs for Ray, whatever ray_start_args say (the last value counts):
                # slime's RolloutManager (1 CPU, no placement group) and other CPU actors
                # stay on training nodes; the fleet's host actors ask for none
                f"{RAY_START} --address {address} --node-ip-address {host} --num-gpus 0 "
                f"--resources {resources} --disable-usage-stats{extra} --num-cpus 0",
                "background",
                note="the job goes on if this host is lost: the trajectories in its sandboxes "
                "end sandbox_error, the fleet opens the next ones on the other hosts",
                needed=False,
                restarts=RAY_JOIN_RESTARTS,
            )
        )
    nodes = 1 + len(hosts.workers) + len(hosts.sandbox)
    steps.append(Step("wait ray cluster", hosts.head, f"{wait} --nodes {nodes}"))
    return steps


def secret_names(job: JobConfig) -> list[str]:
    """Environment variables the job's processes read by name (never by value)."""
    names = list(job.cluster.secret_env)
    if job.teacher.api_key_env and job.algorithm.recipe in RECIPES_WITH_TEACHER:
        names.append(job.teacher.api_key_env)
    if job.rollout.harness == "swe" and job.sandbox.backend == "e2b":
        names.append(job.sandbox.e2b_api_key_env)
    return list(dict.fromkeys(names))


def _submit_command(
    job: JobConfig, hooks_yaml: str, run: str, wait: bool, submission_id: str | None = None
) -> str:
    cluster = job.cluster
    env = {
        "PYTHONPATH": cluster.megatron_dir,
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "OPD_JOB_CONFIG": f"{run}/job.yaml",
        **cluster.env,
        # Ray expands ${NAME} in each worker from its node's environment (ray start's)
        **{name: f"${{{name}}}" for name in secret_names(job)},
    }
    if job.logging.wandb_mode == "offline":
        env["WANDB_MODE"] = "offline"
    if job.logging.wandb_mode != "disabled":  # slime's wandb.init takes its run from these
        env |= {"WANDB_RUN_ID": wandb_run_id(job), "WANDB_RESUME": "allow"}
    runtime_env = shlex.quote(json.dumps({"env_vars": env}, sort_keys=True))
    return (
        f"{_in_slime(job)} && ray job submit --address http://127.0.0.1:{cluster.dashboard_port} "
        + ("" if wait else "--no-wait ")
        + (f"--submission-id {submission_id} " if submission_id else "")
        # the entrypoint runs in the Ray job supervisor's directory, not this one
        + f"--runtime-env-json {runtime_env} -- python3 "
        + shlex.quote(f"{cluster.slime_dir.rstrip('/')}/train.py")
        + ' "${MODEL_ARGS[@]}" '
        + shlex.join(train_args(job, hooks_yaml))
    )


def _in_slime(job: JobConfig) -> str:
    """cd into slime and define MODEL_ARGS, as slime's own run scripts do."""
    script = shlex.quote(str(job.cluster.model_args_script))
    return f"cd {shlex.quote(job.cluster.slime_dir)} && source {script}"


def render_dry_run(steps: list[Step], log_dir: str) -> str:
    """Every step as it would run: `# name @ host` then the command."""
    lines = []
    for number, step in enumerate(steps, start=1):
        lines.append(f"# {number}. {step.name} @ {step.host} ({step.kind})")
        if step.note:
            lines.append(f"# {step.note}")
        if step.restarts:
            lines.append(f"# started again up to {step.restarts} times if it ends before the job")
        if step.kind == "write":
            lines.append(f"cat > {step.command} <<'EOF'\n{step.content.rstrip()}\nEOF")
        elif step.kind == "wait_http":
            lines.append(_wait(step.command))
        elif step.kind == "check_tokenizer":
            lines.append(f"# compare the tokenizer in `curl -s {step.command}` with the student's")
        elif step.kind == "background":
            lines.append(f"nohup {step.command} > {log_dir}/{slug(step.name)}.log 2>&1 &")
        else:
            lines.append(step.command)
    return "\n".join(lines) + "\n"


SBATCH_SUBMISSION_ID = "opd-$SLURM_JOB_ID"
"""The Ray job's id in a batch script's allocation (one Ray cluster per allocation)."""


def render_sbatch(job: JobConfig, path: Path, allow_changed: Sequence[str] = ()) -> str:
    """A Slurm batch script for the whole job.

    The allocation: the training nodes and (teacher.node set) the teacher's node, with
    `parallel.gpus_per_node` GPUs each; the sandbox hosts without GPUs, as a second
    component of a heterogeneous job. Every step runs with `srun --overlap` on its node
    (a step never waits for the node's daemons); daemons (Ray's `ray start --block`,
    SGLang, the teacher service, the snapshot sync) are background steps that live as long
    as the job, and a trap stops them however the script ends; a daemon that ends while a
    later step runs (the teacher's node lost, Ray's head killed) fails that step and the
    job at once, instead of leaving training to time out on it; before the job a daemon
    with restarts (a node's `ray start` joining the head) is started again instead, saying
    why it ended, as the ssh executor does. Nodes' addresses come from
    Slurm (`scontrol show node`: NodeAddr); secrets are passed by name (exported where
    `sbatch` runs, Slurm and srun pass the environment on), never written here."""
    layout, cluster = job.parallel, job.cluster
    teacher_node = job.teacher.node is not None
    gpu_nodes = layout.num_nodes + int(teacher_node)
    cpu_nodes = len(cluster.sandbox_hosts)
    heterogeneous = cpu_nodes > 0
    total = gpu_nodes + cpu_nodes
    # commands name nodes by address ($ADDR_i); srun -w by Slurm name ($NODE_i)
    hosts = Hosts(
        "$ADDR_0",
        [f"$ADDR_{i}" for i in range(1, layout.num_nodes)],
        f"$ADDR_{layout.num_nodes}" if teacher_node else None,
        [f"$ADDR_{gpu_nodes + i}" for i in range(cpu_nodes)],
    )
    run = str(job.logging.run_dir)
    steps = build_plan(
        job, hosts, run, wait_for_job=True, allow_changed=allow_changed,
        submission_id=SBATCH_SUBMISSION_ID,
    )  # fmt: skip
    gpus = layout.gpus_per_node
    options = [f"#SBATCH {option}" for option in cluster.sbatch_options]
    lines = [
        "#!/usr/bin/env bash",
        f"#SBATCH --job-name={slug(job.logging.wandb_project)}",
        f"#SBATCH --output={run}/logs/slurm-%j.out",
        f"#SBATCH --nodes={gpu_nodes}",
        "#SBATCH --ntasks-per-node=1",
        *([f"#SBATCH --gpus-per-node={gpus}"] if gpus else []),
        "#SBATCH --exclusive",
        *options,
    ]
    if heterogeneous:
        lines += [
            "#SBATCH hetjob",
            f"#SBATCH --nodes={cpu_nodes}",
            "#SBATCH --ntasks-per-node=1",
            "#SBATCH --exclusive",
            *options,
        ]
    names = 'scontrol show hostnames "${SLURM_JOB_NODELIST_HET_GROUP_0:-$SLURM_JOB_NODELIST}"'
    lines += [
        "# Written by `opd launch --sbatch`; submit with: sbatch " + str(path),
        "# Secrets are read by name from the environment sbatch runs in: "
        + (", ".join(secret_names(job)) or "none"),
        "set -euo pipefail",
        *(
            f': "${{{name}:?{name} is unset: export it where sbatch runs (the job reads it '
            'by name)}"'
            for name in secret_names(job)
        ),
        "# sbatch from an ssh login passes these on: each `bash -c` Ray starts a worker with",
        "# would then read ~/.bashrc (whose pyenv or conda could shadow this job's python3)",
        "unset SSH_CLIENT SSH2_CLIENT",
        f"LOGS={shlex.quote(run)}/logs",
        'mkdir -p "$LOGS"',
        f"mapfile -t GPU_NODES < <({names})",
    ]
    if heterogeneous:
        lines.append(
            'mapfile -t CPU_NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_1")'
        )
    lines.append('addr() { scontrol show node "$1" | tr " " "\\n" | sed -n "s/^NodeAddr=//p"; }')
    group_of = {}
    for i in range(total):
        source = f"GPU_NODES[{i}]" if i < gpu_nodes else f"CPU_NODES[{i - gpu_nodes}]"
        lines.append(f'export NODE_{i}="${{{source}}}"; export ADDR_{i}="$(addr "$NODE_{i}")"')
        group_of[f"$ADDR_{i}"] = (f"$NODE_{i}", 0 if i < gpu_nodes else 1)
    srun = ["srun"]
    if heterogeneous:
        srun.append('--het-group="$group"')
    srun += [
        "--nodes=1",
        "--ntasks=1",
        '-w "$host"',
        "--overlap",
        '${gpus:+--gpus-per-node="$gpus"}',
    ]
    srun += [shlex.quote(option) for option in cluster.srun_options]
    shell = " ".join(shlex.quote(part) for part in cluster.remote_shell)
    on_host = f"{' '.join(srun)} {shell}"  # one task on $host (group, gpus): step()'s launch
    head_node, head_group = group_of[hosts.head]
    stop_job = (
        f"ray job stop --address http://127.0.0.1:{cluster.dashboard_port} {SBATCH_SUBMISSION_ID}"
    )
    lines += [
        "DAEMONS=() JOB_STARTED=0",
        "# the daemons watched while a step runs: pid, name, restarts left and done, needed",
        "W_PID=() W_NAME=() W_LEFT=() W_DONE=() W_NEEDED=() W_STEP=()",
        "teardown() {",
        "  local status=$?",
        "  trap - EXIT INT TERM",
        '  if [ "$JOB_STARTED" = 1 ]; then  # its driver would outlive Ray under linuxproc',
        f'    echo "teardown: stopping the Ray job {SBATCH_SUBMISSION_ID}"',
        f'    local group={head_group} gpus="" host="{head_node}"  # as step() has them',
        f'    timeout 60 {on_host} {shlex.quote(stop_job)} > "$LOGS/ray-job-stop.log" 2>&1 || true',
        "  fi",
        '  echo "teardown: stopping ${#DAEMONS[@]} daemon step(s)"',
        '  for pid in "${DAEMONS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done',
        '  for pid in "${DAEMONS[@]}"; do wait "$pid" 2>/dev/null || true; done',
        '  exit "$status"',
        "}",
        "trap teardown EXIT INT TERM",
        "# step GROUP GPUS HOST COMMAND: one task on HOST, sharing the node with its other steps",
        "step() {",
        "  local group=$1 gpus=$2 host=$3; shift 3",
        f'  {on_host} "$*"',
        "}",
        "# watch_daemon NAME RESTARTS NEEDED GROUP GPUS HOST COMMAND: start it, watched by steps",
        "watch_daemon() {",
        "  local name=$1 restarts=$2 needed=$3; shift 3",
        '  step "$@" > "$LOGS/$name.log" 2>&1 &',
        '  DAEMONS+=("$!") W_PID+=("$!") W_NAME+=("$name") W_LEFT+=("$restarts") W_DONE+=(0)',
        '  W_NEEDED+=("$needed") W_STEP+=("$(printf "%q " "$@")")',
        "}",
        "# daemon NAME RESTARTS GROUP GPUS HOST COMMAND: a step the job needs, left running",
        "# until it ends; one that ends before the job is started again, RESTARTS times at most",
        'daemon() { watch_daemon "$1" "$2" 1 "${@:3}"; }',
        "# beside NAME RESTARTS GROUP GPUS HOST COMMAND: a background step the job may outlive",
        "# (restarted as a daemon is; one with no restarts is not watched: it may end itself)",
        "beside() {",
        '  if [ "$2" -gt 0 ]; then watch_daemon "$1" "$2" 0 "${@:3}"; return; fi',
        '  step "${@:3}" > "$LOGS/$1.log" 2>&1 &',
        '  DAEMONS+=("$!")',
        "}",
        "# again I: start watched daemon I again, saying why it ended (its log's last lines)",
        "again() {",
        "  local i=$1 name=${W_NAME[$1]} n=$(( ${W_DONE[$1]} + 1 ))",
        "  W_DONE[$i]=$n W_LEFT[$i]=$(( ${W_LEFT[$i]} - 1 ))",
        '  mv -f "$LOGS/$name.log" "$LOGS/$name.log.$n"',
        '  echo "daemon $name ended before the job started ($(tail -n 3 "$LOGS/$name.log.$n"'
        " | paste -sd ' ' - | cut -c1-500)); starting it again ($n of $(( n + ${W_LEFT[$i]} ));"
        ' its log: $LOGS/$name.log.$n)" >&2',
        '  eval "step ${W_STEP[$i]}" > "$LOGS/$name.log" 2>&1 &',
        '  DAEMONS+=("$!") W_PID[$i]=$!',
        "}",
        "# watched COMMAND: runs COMMAND; a daemon the job needs that ends meanwhile (and cannot",
        "# be started again) fails it and the job; one the job may outlive is reported once",
        "watched() {",
        '  "$@" &',
        "  local main=$! i after",
        '  while kill -0 "$main" 2>/dev/null; do',
        '    for i in "${!W_PID[@]}"; do',
        '      kill -0 "${W_PID[$i]}" 2>/dev/null && continue',
        '      [ "${W_NEEDED[$i]}" = gone ] && continue',
        '      if [ "$JOB_STARTED" = 0 ] && [ "${W_LEFT[$i]}" -gt 0 ]; then',
        '        again "$i"',
        "        continue",
        "      fi",
        '      if [ "${W_NEEDED[$i]}" = 0 ]; then',
        "        W_NEEDED[$i]=gone",
        '        echo "daemon ${W_NAME[$i]} ended (its log: $LOGS/${W_NAME[$i]}.log): the job'
        ' goes on without it" >&2',
        "        continue",
        "      fi",
        '      after=""; [ "${W_DONE[$i]}" -gt 0 ] && after=", after ${W_DONE[$i]} restart(s)"',
        '      echo "daemon ${W_NAME[$i]} ended while the job ran (its log:'
        ' $LOGS/${W_NAME[$i]}.log$after): stopping the job" >&2',
        '      kill -TERM "$main" 2>/dev/null || true',
        '      wait "$main" 2>/dev/null || true',
        "      return 1",
        "    done",
        "    sleep 1",
        "  done",
        '  wait "$main"',
        "}",
    ]
    for step in steps:
        lines.append(f"# {step.name}")
        if step.note:
            lines.append(f"# {step.note}")
        if step.kind == "write":  # unquoted: the teacher's $ADDR_i expands
            lines.append(f"cat > {step.command} <<EOF\n{step.content.rstrip()}\nEOF")
            continue
        if step.kind == "wait_http":
            lines.append(f"watched {_wait(step.command)}")
            continue
        if step.kind == "check_tokenizer":  # on the head, in the steps' environment
            node, group = group_of[hosts.head]
            check = shlex.quote(check_teacher_command(job, step.command))
            lines.append(f'watched step {group} "" "{node}" {check}')
            continue
        node, group = group_of[step.host]
        where = f'{group} "{gpus if step.gpus and group == 0 else ""}" "{node}"'
        if step.kind == "background":
            starter = "beside" if step.ends_itself or not step.needed else "daemon"
            name = f"{slug(step.name)} {step.restarts}"
            lines.append(f"{starter} {name} {where} {shlex.quote(step.command)}")
            continue
        if step is steps[-1]:  # the job: no daemon is started again from here on
            lines.append("JOB_STARTED=1")
        lines.append(f"watched step {where} {shlex.quote(step.command)}")
    # `ray job submit` returned: the job ended; the trap stops the daemons
    return "\n".join(lines) + "\n"


def slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")
