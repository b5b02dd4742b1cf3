"""The job configuration: one pydantic model per section, loaded from YAML.

Every part of the system is built from its section of `JobConfig`. Later issues add
fields to their section; unknown keys are always an error (a typo must not silently fall
back to a default).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

Recipe = Literal["opd", "opsd", "oprd", "ssd", "rl", "sft"]
RECIPES_WITH_TEACHER: frozenset[str] = frozenset({"opd", "opsd", "oprd"})
OPRD_ON_SLIME = (
    "recipe 'oprd' on slime (a cluster job) needs algorithm.oprd_failure_loss sampled or "
    "teacher_topk (with teacher.top_k > 0): a cluster job's teacher is a service that gives "
    "the log-prob of each sampled token and its top-k, not the full distribution "
    "shared_support needs (its teacher runs in the local trainer's process); train "
    "shared_support with the local trainer (`opd train`, parallel.gpus_per_node: 0)"
)
"""Why the slime hooks and the cluster launch refuse OPRD's shared_support failure loss."""


class ConfigError(ValueError):
    """A configuration file or override that cannot be used, with every problem listed."""


class Section(BaseModel):
    # each setting's docstring is its description (`opd config show --explain`)
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True
    )


class ModelConfig(Section):
    student: str = "factory:qwen3-tiny"
    """Student checkpoint: a local HF directory, `factory:<preset>` for a small random-init
    model built by `slime_ext.models.factory` (deterministic by `seed`), or `bundled:student`
    (the demo's SFT-trained student)."""
    tokenizer: str | None = None
    """Tokenizer directory; defaults to the student's own."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of the trainer's model. Log-softmax is always computed in fp32."""
    seed: int = 0
    """Seed for factory models and for everything random in the job."""


class ParallelConfig(Section):
    num_nodes: int = Field(default=1, ge=1)
    """Training nodes (the teacher's node is counted in `teacher`, not here)."""
    gpus_per_node: int = Field(default=0, ge=0)
    """GPUs per training node; 0 means the embedded CPU trainer."""
    tp: int = Field(default=1, ge=1)
    """Tensor-parallel size (the vocabulary is sharded over it)."""
    cp: int = Field(default=1, ge=1)
    """Context-parallel size."""
    pp: int = Field(default=1, ge=1)
    """Pipeline-parallel size."""
    max_tokens_per_gpu: int = Field(default=38_912, ge=1)
    """Token budget of one micro-batch on one GPU (slime's --max-tokens-per-gpu)."""
    dp: int | None = Field(default=None, ge=1)
    """Data-parallel size; derived from the others when omitted, checked when given."""
    ep: int = Field(default=1, ge=1)
    """Expert-parallel size (MoE students)."""
    etp: int = Field(default=1, ge=1)
    """Expert-tensor-parallel size (MoE students)."""
    num_experts: int | None = Field(default=None, ge=1)
    """Routed experts per MoE layer (MoE students; checked against ep)."""
    colocate: bool = True
    """SGLang rollout engines share the training GPUs (slime's --colocate)."""
    rollout_gpus_per_engine: int | None = Field(default=None, ge=1)
    """GPUs per SGLang rollout engine (slime's --rollout-num-gpus-per-engine); default tp."""
    rollout_gpus: int | None = Field(default=None, ge=1)
    """With colocate: false, the GPUs of the SGLang rollout engines, on top of the training
    GPUs (slime's --rollout-num-gpus); required then, and only then."""

    @property
    def world_size(self) -> int:
        return self.num_nodes * max(self.gpus_per_node, 1)

    @property
    def data_parallel(self) -> int:
        """Data-parallel size: world / (tp * cp * pp)."""
        return self.world_size // (self.tp * self.cp * self.pp)

    @model_validator(mode="after")
    def _layout_divides_world(self) -> ParallelConfig:
        model_parallel = self.tp * self.cp * self.pp
        if self.gpus_per_node == 0:
            if model_parallel != 1:
                raise ValueError(
                    f"tp * cp * pp = {model_parallel} needs GPUs: set gpus_per_node, "
                    "or keep tp = cp = pp = 1 for the embedded CPU trainer"
                )
        elif self.world_size % model_parallel != 0:
            rest = self.cp * self.pp
            fits = [t for t in range(1, self.world_size + 1) if self.world_size % (t * rest) == 0]
            fix = (
                f"set tp to one of {', '.join(map(str, fits))} (with cp {self.cp}, pp {self.pp})"
                if fits
                else f"lower cp x pp ({rest}) to a divisor of {self.world_size}"
            )
            raise ValueError(
                f"tp * cp * pp = {self.tp} * {self.cp} * {self.pp} = {model_parallel} does "
                f"not divide num_nodes * gpus_per_node = {self.world_size}: {fix}, or change "
                "the node or GPU count"
            )
        if self.dp is not None and self.dp * model_parallel != self.world_size:
            raise ValueError(
                f"tp x cp x dp x pp = {self.tp} x {self.cp} x {self.dp} x {self.pp} = "
                f"{self.dp * model_parallel} GPUs, but num_nodes x gpus_per_node = "
                f"{self.num_nodes} x {self.gpus_per_node} = {self.world_size}: set dp to "
                f"{self.world_size // model_parallel} or omit it"
            )
        if not self.colocate and self.rollout_gpus is None:
            raise ValueError(
                "colocate: false puts the rollout engines on GPUs of their own: set "
                "rollout_gpus (slime's --rollout-num-gpus), or colocate: true"
            )
        if self.colocate and self.rollout_gpus is not None:
            raise ValueError(
                "rollout_gpus is for colocate: false (colocated engines use the training "
                "GPUs): remove it, or set colocate: false"
            )
        experts = self.ep * self.etp
        dense = self.world_size // self.pp
        if experts > 1 and dense % experts != 0:
            raise ValueError(
                f"ep x etp = {self.ep} x {self.etp} = {experts} must divide tp x cp x dp = "
                f"{dense} (the GPUs of one pipeline stage): change ep or etp"
            )
        if self.num_experts is not None and self.num_experts % self.ep != 0:
            raise ValueError(
                f"num_experts {self.num_experts} is not divisible by ep {self.ep}: each "
                "expert-parallel rank must hold the same number of experts"
            )
        return self


class RolloutConfig(Section):
    harness: Literal["tir", "swe"] = "tir"
    """Agent harness: math tool-integrated reasoning (python tool) or SWE (bash + submit)."""
    think_policy: Literal["drop", "keep"] = "drop"
    """Whether a turn's reasoning is carried into later contexts (see DESIGN.md)."""
    tool_call_format: Literal["hermes", "qwen3_coder"] = "hermes"
    """How the model writes tool calls."""
    max_turns: int = Field(default=16, ge=1)
    """Turns (model calls) per trajectory before it ends as truncated."""
    max_new_tokens: int = Field(default=512, ge=1)
    """Generation budget of one turn."""
    max_context_tokens: int = Field(default=4096, ge=16)
    """Longest context a turn may see; a trajectory that outgrows it ends as truncated."""
    temperature: float = Field(default=1.0, ge=1e-2, le=1e2)
    """Sampling temperature. KL losses use this same temperature on both sides, so it lies
    where the teacher service scores (teacher_server.api MIN/MAX_TEMPERATURE: [0.01, 100])."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus truncation; 1.0 (off) keeps OPD samples on-policy. On a cluster (`opd
    launch`) recipes that sample (opd, opsd, oprd, rl) need 1.0: slime cannot train our
    per-turn samples under top-p (launch/README.md)."""
    top_k: int = Field(default=-1, ge=-1)
    """Top-k truncation; -1 is off (and needed on a cluster, as top_p 1.0)."""
    tasks_per_step: int = Field(default=8, ge=1)
    """Distinct tasks sampled for one training step."""
    samples_per_task: int = Field(default=1, ge=1)
    """Trajectories per task (a group, for group-normalized RL). A step trains on
    tasks_per_step x samples_per_task trajectories; recipes sft and ssd on a cluster read
    that many records' trajectories per step (slime's --rollout-batch-size then counts
    trajectories, with --n-samples-per-prompt 1)."""
    concurrency: int = Field(default=8, ge=1)
    """Trajectories in flight at once."""
    rounds: bool = True
    """One machine (`opd train`, `opd demo`): the local student decodes in rounds, every
    generating trajectory's next turn in one batch, the batches fixed by the schedule
    (rollout/rounds.py): fast, and the same run on an idle or a loaded machine for a given
    concurrency. False: each turn decoded alone (batch-invariant whatever the concurrency;
    slower). A cluster job's SGLang engines batch on their own and ignore it."""
    trajectory_timeout_s: float = Field(default=600.0, gt=0.0)
    """Wall-clock limit of one trajectory; past it the trajectory ends as aborted."""


class SandboxConfig(Section):
    """Where SWE agents' commands run (TIR's python tool always runs in a local sandbox)."""

    backend: Literal["auto", "local", "docker", "e2b"] = "auto"
    """local: own uid under bubblewrap, no images (mini-SWE); docker: the task's image in
    a container; e2b: an E2B cloud sandbox from the template mapped to the task's image
    (`images`); auto: docker for tasks that name an image, local for the others."""
    hosts: Literal["auto", "here", "ray"] = "auto"
    """Where local and docker sandboxes start: here (this process's machine and its Docker
    daemon); ray (one host actor on every Ray node offering the `opd_sandbox_host`
    resource: the nodes `opd launch` starts on cluster.sandbox_hosts; a process outside
    Ray joins the cluster at RAY_ADDRESS); auto: ray for a cluster job whose
    cluster.sandbox_hosts names any, here otherwise. `fleet_file` overrides it."""
    fleet_file: str | None = None
    """A fleet YAML ({config: fleet settings, hosts: [host settings, ...]}) naming the
    hosts and their daemons itself; the limits below then come from that file. Read where
    the sandboxes are opened (on a cluster, the rollout process's node): give an absolute
    path on shared storage."""
    command_timeout_s: float = Field(default=30.0, gt=0.0)
    """Deadline of one command or python call."""
    memory_mb: int = Field(default=2048, ge=16)
    """Memory limit of one sandbox (Docker: the container, tmpfs included; local: each
    process's address space)."""
    cpus: float = Field(default=1.0, gt=0.0)
    """CPU quota of one Docker sandbox, in cores."""
    max_processes: int = Field(default=256, ge=8)
    """Processes and threads of one sandbox at once."""
    scratch_mb: int = Field(default=512, ge=1)
    """Memory-backed scratch working directory of one Docker sandbox (the task's own
    repository lives in the container's writable layer)."""
    network: bool = False
    """Whether sandboxed code may use the network (Docker: the bridge network)."""
    max_sandboxes: int = Field(default=16, ge=1)
    """Sandboxes at once on each host (handed out plus warm)."""
    warm_per_image: int = Field(default=0, ge=0)
    """Started sandboxes each host keeps ready per image; 0: every start is cold."""
    image: str | None = None
    """Docker: the image of tasks that name none; e2b: their template."""
    images: dict[str, str] = Field(default_factory=dict)
    """A task's image -> what runs it: another image (docker) or an E2B template (e2b)."""
    registry: str | None = None
    """Docker: prefix of task images not in `images` (e.g. registry.internal:5000/)."""
    e2b_api_key_env: str = "E2B_API_KEY"
    """e2b: the environment variable holding the E2B API key."""

    @field_validator("registry")
    @classmethod
    def _registry_is_a_prefix(cls, value: str | None) -> str | None:
        if value is not None and (not value.strip() or any(c.isspace() for c in value)):
            raise ValueError("a registry prefix like registry.internal:5000/ (no spaces)")
        return value


class TeacherConfig(Section):
    kind: Literal["embedded", "remote", "self"] = "embedded"
    """embedded: `opd` starts the teacher server on 127.0.0.1; remote: a standalone
    `opd-teacher` service at `url`; self: a frozen snapshot of the student (OPSD/OPRD)."""
    model: str | None = "factory:qwen3-small"
    """Teacher checkpoint: for `embedded` a HF directory or `factory:<preset>`; on a cluster
    the HF directory `opd launch` serves on `node`. kind `self` defaults to model.student
    (the student's initial weights: the frozen snapshot); name a copy of that checkpoint
    (e.g. on the teacher node's local disk) to serve it from elsewhere."""
    backend: Literal["hf", "sglang"] = "hf"
    """Scoring backend of the embedded server."""
    url: str | None = None
    """Base URL of a remote teacher service, e.g. http://teacher-node:8000; with `node` set,
    http://<node>:<port> when not given."""
    api_key_env: str | None = None
    """Name of the environment variable holding the teacher service's API key. A cluster
    job (`opd launch`) needs one, unless `unauthenticated` says otherwise on purpose."""
    unauthenticated: bool = False
    """Cluster: score with a teacher that has no API key, on purpose. The service `opd
    launch` starts then binds the node's own address only (not 0.0.0.0), and anyone who
    can reach that address and port can use it; api_key_env must be unset."""
    top_k: int = Field(default=0, ge=0)
    """Teacher top-k log-probs per span token (0: the sampled token's log-prob only)."""
    request_timeout_s: float = Field(default=120.0, gt=0.0)
    """Deadline of one scoring request."""
    node: str | None = None
    """Cluster: the host `opd launch` starts the teacher service on (None: already running
    at `url`, started by someone else)."""
    port: int = Field(default=8000, ge=1, le=65535)
    """Cluster: the teacher service's port on `node`."""
    tp: int = Field(default=1, ge=1)
    """Cluster, sglang backend: SGLang's tensor-parallel size on the teacher node."""
    serve_args: list[str] = Field(default_factory=list)
    """Cluster: extra `opd-teacher serve` arguments (e.g. --max-queue 4096)."""
    hint: Literal["reference", "critic", "student", "none"] = "reference"
    """OPSD: what the self-teacher's context carries: the task's reference solution (its
    method, never the value; written before the rollout), a critic model's hint
    (critic_url), the student's own hint (the policy that samples the rollouts, asked with
    the critic's prompt), or nothing (a control). critic and student read the finished
    attempt: one hint per trajectory, and its turns are scored once it ended."""
    critic_url: str | None = None
    """OpenAI-compatible base URL of the critic model (hint: critic)."""
    critic_model: str = "critic"
    critic_api_key_env: str | None = None
    """Name of the environment variable holding the critic endpoint's API key."""
    hint_attempt_tokens: int = Field(default=8192, ge=16)
    """hint critic / student: the attempt shown to the hint writer is its trajectory (actions
    and observations, as the student's chat template renders them), cut to its last this
    many tokens (where it ended)."""
    hint_max_new_tokens: int = Field(default=1024, ge=1)
    """hint student: the generation budget of the student's hint, its think included (only
    the text after the think is the hint; a hint cut off by the budget is not used)."""
    reminders: str = "rules"
    """OPRD: where the self-teacher's reminders come from: rules (task-level global
    reminders, and per observation: errors, failing tests, repeated and invalid actions;
    rollout/reminders.py), none (a control: the teacher reads the student's context), or
    a dotted path to a rollout.reminders.ReminderSource class (built with no arguments)."""
    reminders_file: Path | None = None
    """OPRD, reminders rules: a YAML of reminder templates, global reminders by task kind
    and rules, in the format of the packaged rollout/reminders.yaml (its default)."""
    snapshot: Literal["fixed", "ema", "refresh"] = "fixed"
    """Self-teachers (OPSD/OPRD): the student's initial weights throughout (fixed), an
    exponential moving average of the student (ema), or the student's weights copied in at
    the fractions of training in `refresh_at` (refresh); the service reloads them (or the
    trainer's in-process teacher takes them). Recipe oprd defaults to refresh. On a cluster
    (`opd launch`) `opd-teacher sync` on the teacher node converts slime's checkpoints of
    those steps to HF and reloads the service; its EMA averages the checkpoints saved every
    `ema_sync_every` steps, not every step (teacher_server/snapshot_sync.py)."""
    refresh_at: list[float] = Field(default_factory=lambda: [0.2, 0.4, 0.6, 0.8])
    """snapshot refresh: fractions of training at which the teacher takes the student's weights."""
    ema_decay: float = Field(default=0.99, gt=0.0, lt=1.0)
    ema_sync_every: int = Field(default=5, ge=1)
    """snapshot ema: steps between pushing the average to the teacher service."""
    snapshot_converter: str | None = None
    """Cluster, snapshot ema / refresh: the command the teacher node runs to convert one of
    slime's Megatron checkpoints to HF, a template with {input_dir}, {output_dir},
    {origin_hf_dir} and {vocab_size} (shell-quoted when filled in). Default: slime's
    tools/convert_torch_dist_to_hf.py in cluster.slime_dir, Megatron from
    cluster.megatron_dir (the teacher node needs both, as slime's image has them)."""

    @field_validator("refresh_at")
    @classmethod
    def _fractions_of_training(cls, refresh_at: list[float]) -> list[float]:
        if not all(0 < f <= 1 for f in refresh_at):
            raise ValueError("each fraction of training must lie in (0, 1]")
        return refresh_at

    @model_validator(mode="after")
    def _kind_has_its_fields(self) -> TeacherConfig:
        if self.kind == "remote" and not self.url and self.node:
            # the service `opd launch` starts on `node` (written without re-validation)
            self.__dict__["url"] = f"http://{self.node}:{self.port}"
        if self.kind == "remote" and not self.url:
            raise ValueError(
                "kind 'remote' needs url (the opd-teacher service's base URL) or node (the "
                "host `opd launch` starts it on)"
            )
        if self.unauthenticated and self.api_key_env:
            raise ValueError(
                f"unauthenticated true serves the teacher without a key, but api_key_env "
                f"names {self.api_key_env}: remove one of them"
            )
        if self.hint == "critic" and not self.critic_url:
            raise ValueError("hint 'critic' needs critic_url (an OpenAI-compatible endpoint)")
        if self.kind == "embedded" and not self.model:
            raise ValueError("kind 'embedded' needs model (a HF directory or factory:<preset>)")
        if self.reminders not in ("rules", "none") and "." not in self.reminders:
            raise ValueError(
                f"reminders {self.reminders!r}: use rules, none, or a dotted path "
                "package.module.Class to a ReminderSource"
            )
        return self


class AlgorithmConfig(Section):
    recipe: Recipe = "opd"
    """Training signal: opd (separate teacher), opsd / oprd (self-teacher with a hint or
    reminders), ssd (SFT on own samples), rl (outcome reward), sft (on given traces)."""
    steps: int = Field(default=20, ge=1)
    """Optimizer steps."""
    lr: float = Field(default=1e-4, gt=0.0)
    """AdamW learning rate: the peak of the schedule (`lr_schedule`)."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """The learning rate after warmup: `lr` throughout (constant), or decaying from `lr` to
    `min_lr` over the steps after warmup, along a half cosine or a straight line; it would
    reach `min_lr` at step `steps`, so the last step trains just above it. Megatron's
    OptimizerParamScheduler formula, used on both paths (the cluster's --lr-decay-style)."""
    lr_warmup_steps: int = Field(default=0, ge=0)
    """Optimizer steps of linear warmup: step s (from 0) trains at lr * s / lr_warmup_steps,
    so the first trains at 0 (Megatron's --lr-warmup-init); must be below `steps`, as
    Megatron requires. 0: no warmup."""
    min_lr: float = Field(default=0.0, ge=0.0)
    """The floor cosine and linear decay towards (Megatron's --min-lr); at most `lr`. The
    constant schedule ignores it."""
    weight_decay: float = Field(default=0.0, ge=0.0)
    grad_clip: float = Field(default=1.0, gt=0.0)
    """Global gradient-norm clip."""
    kl_coef: float = Field(default=1.0, ge=0.0)
    """Weight of the per-token reverse-KL advantage."""
    reward_weight: float = Field(default=0.0, ge=0.0)
    """opd / opsd: add the group-normalized outcome advantage (recipe rl's, groups of
    rollout.samples_per_task), times this weight, to the per-token KL advantage: OPD plus
    outcome reward. 0: the teacher's signal alone. Local trainer only."""
    opd_loss: Literal["sampled", "topk_tail", "topk_renorm"] = "sampled"
    """OPD's per-token loss: the sampled reverse KL in policy-gradient form, or the reverse
    KL against the teacher's top-k (teacher.top_k > 0) with a tail bucket or renormalized."""
    kl_discount: float = Field(default=0.0, ge=0.0, lt=1.0)
    """opd / opsd with opd_loss sampled: each token's advantage is the discounted sum of the
    reverse KL of it and of every later token of its trajectory, later turns included
    (tinker-cookbook's kl_discount_factor): a token is charged for the divergence it leads
    to. 0: each token its own KL. On a cluster only where a trajectory is one sample
    (sequence_layout packed) and parallel.cp is 1."""
    train_on_invalid_turns: bool = True
    """Whether KL-to-teacher losses train on tier-1/2 invalid turns (imitation losses never do)."""
    oprd_success_weight: float = Field(default=1.0, ge=0.0)
    """OPRD's lambda_+: weight of the success branch (self-imitation NLL of trajectories
    with reward > 0, invalid turns masked)."""
    oprd_failure_weight: float = Field(default=1.0, ge=0.0)
    """OPRD's lambda_-: weight of the failure branch (reverse KL to the reminded teacher)."""
    oprd_failure_loss: Literal["shared_support", "teacher_topk", "sampled"] = "shared_support"
    """OPRD's failure branch: shared_support (KL on the top-`oprd_support_k` ids of
    max(log p_S, log p_T), both renormalized; the teacher runs in the trainer's process,
    where both full distributions exist: local trainer only), teacher_topk (KL to the
    teacher service's top-k with a tail bucket; needs teacher.top_k > 0; local and
    cluster), or sampled (the sampled-token reverse KL k_t = log p_S(x_t) - log p_T(x_t)
    on the student's own token, in policy-gradient form as recipe opd trains it: a
    one-token estimate of the full-vocabulary reverse KL, not the paper's shared-support
    KL; the cheapest signal, k x 8 bytes per token less than teacher_topk on a cluster)."""
    oprd_support_k: int = Field(default=100, ge=1)
    """OPRD shared_support: size of the shared support U (the paper: 100)."""
    sequence_layout: Literal["auto", "packed", "per_turn"] = "auto"
    """How a trajectory is laid out for training: packed (one sequence, every token once;
    exact for full-attention models), per_turn (a sequence per turn, its context
    recomputed), or auto (packed where exact). Locally the trainer decides from the model;
    on the cluster `opd launch` decides from the student's config.json, or its name for a
    hybrid family, and says why (slime_ext/job/sequence_layout.py); packed gives slime one
    tree-packed sample per trajectory and Megatron the tree attention."""

    @model_validator(mode="after")
    def _schedule_fits_training(self) -> AlgorithmConfig:
        if self.min_lr > self.lr:
            raise ValueError(
                f"min_lr ({self.min_lr}) is above lr ({self.lr}): the schedule decays from lr "
                "down to min_lr; lower min_lr or raise lr"
            )
        if self.lr_warmup_steps >= self.steps:
            raise ValueError(
                f"lr_warmup_steps ({self.lr_warmup_steps}) must be below steps "
                f"({self.steps}): warmup would not end before training does (Megatron's "
                "scheduler refuses it); lower lr_warmup_steps"
            )
        return self


class LoggingConfig(Section):
    run_dir: Path = Path("runs/default")
    """Where checkpoints, metrics.jsonl and trajectories are written."""
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """W&B mode; `online` needs WANDB_API_KEY."""
    wandb_project: str = "opd"
    wandb_group: str | None = None
    wandb_entity: str | None = None
    """W&B team or user (slime's --wandb-team; `opd dashboard` needs it)."""
    log_every_steps: int = Field(default=1, ge=1)
    save_every_steps: int = Field(default=10, ge=1)
    keep_checkpoints: int = Field(default=3, ge=1)
    """Local trainer: checkpoints kept in run_dir/checkpoints/ (one per save step), the
    newest; run_dir/checkpoint links to the newest."""
    save_trajectories: bool = True
    """Write every trajectory of every step to run_dir/trajectories/ as JSONL."""
    eval_every_steps: int = Field(default=0, ge=0)
    """Local trainer: greedy held-out accuracy of the student after every this many steps,
    printed and logged with that step's metrics (eval/heldout_accuracy, its 95% interval);
    0: off."""
    eval_problems: int = Field(default=64, ge=1)
    """Held-out problems per periodic evaluation: the first this many of the demo's held-out
    set (what `opd demo` evaluates before and after training)."""


class ClusterConfig(Section):
    """Where a cluster job runs and how `opd launch` reaches its nodes."""

    executor: Literal["ssh", "srun", "local"] = "ssh"
    """How commands reach a node: ssh, srun (inside a Slurm allocation), or local (every
    host is this machine)."""
    head: str | None = None
    """The first training node: Ray's head, where the job is submitted."""
    workers: list[str] = Field(default_factory=list)
    """The other training nodes (num_nodes - 1 of them)."""
    sandbox_hosts: list[str] = Field(default_factory=list)
    """CPU nodes that join the Ray cluster to run sandboxes."""
    ssh_command: list[str] = Field(default_factory=lambda: ["ssh", "-o", "BatchMode=yes"])
    """The ssh program and its options; the host and the command are appended."""
    remote_shell: list[str] = Field(default_factory=lambda: ["bash", "-lc"])
    """How a node runs a step's command (a login shell picks up modules and conda)."""
    slime_dir: str = "/root/slime"
    """slime's checkout on the nodes (slime's image: /root/slime)."""
    megatron_dir: str = "/root/Megatron-LM"
    model_args_script: str | None = None
    """slime's scripts/models/<arch>.sh for the student (defines MODEL_ARGS)."""
    megatron_checkpoint: str | None = None
    """The student as a Megatron torch_dist checkpoint (--ref-load); converted from
    model.student by `opd launch` when it does not exist yet."""
    save_dir: str | None = None
    """Where Megatron checkpoints of this run go (--load / --save); shared storage."""
    tasks_file: str | None = None
    """Training tasks as JSONL rows {prompt, label, metadata: {task: ...}} (--prompt-data);
    recipes sft and ssd: the pre-tokenized per-turn records (slime_ext.sft_data, .jsonl or
    .parquet) that slime_ext.slime.sft_rollout feeds."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables of the Ray job (added to slime's usual ones)."""
    extra_train_args: list[str] = Field(default_factory=list)
    """More slime / Megatron arguments, appended as given. Flags our hooks cannot honour,
    and those the plan sets from this config, are refused with the reason
    (slime_ext/job/slime_flags.py)."""
    ray_port: int = Field(default=6379, ge=1, le=65535)
    dashboard_port: int = Field(default=8265, ge=1, le=65535)
    ray_start_args: list[str] = Field(default_factory=list)
    """More `ray start` arguments on every node (e.g. --temp-dir, port ranges), appended as
    given; a node's own shell expands them ($SLURMD_NODENAME under Slurm)."""
    ray_wait_s: int = Field(default=600, ge=1)
    """How long the plan waits for the Ray cluster to have every node before failing."""
    secret_env: list[str] = Field(default_factory=list)
    """Names of environment variables the Ray job needs (e.g. WANDB_API_KEY, HF_TOKEN),
    passed by name: each process reads the value from its node's environment (exported
    where `opd launch` or `sbatch` runs), never written into a plan or a log. The
    teacher's teacher.api_key_env is passed this way without being listed."""
    sbatch_options: list[str] = Field(default_factory=list)
    """Slurm options of `opd launch --sbatch` for every part of the allocation (e.g.
    --partition=gpu, --account=proj, --time=48:00:00), written as #SBATCH lines."""
    srun_options: list[str] = Field(default_factory=list)
    """Options of every srun step in the batch script (e.g. a container runtime:
    --container-image=... with pyxis, --container-mounts=...)."""


class JobConfig(Section):
    """A whole job. Every section has defaults (a small local OPD job on factory models);
    launch/configs/demo.yaml is what `opd demo` trains."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)

    @model_validator(mode="after")
    def _sections_agree(self) -> JobConfig:
        recipe = self.algorithm.recipe
        if recipe in ("opsd", "oprd") and self.teacher.kind != "self":
            raise ValueError(
                f"recipe '{recipe}' distills from a frozen snapshot of the student: "
                "set teacher.kind: self"
            )
        if recipe == "oprd" and "snapshot" not in self.teacher.model_fields_set:
            self.teacher.snapshot = "refresh"  # OPRD refreshes at 20/40/60/80% by default
        if (
            recipe == "oprd"
            and self.algorithm.oprd_failure_loss == "teacher_topk"
            and self.teacher.top_k == 0
        ):
            raise ValueError(
                "algorithm.oprd_failure_loss 'teacher_topk' needs the teacher's top-k: set "
                "teacher.top_k > 0 (or use shared_support with the in-process teacher)"
            )
        unset = "model" not in self.teacher.model_fields_set or self.teacher.model is None
        if self.teacher.kind == "self" and unset:
            self.teacher.model = self.model.student  # the frozen snapshot's checkpoint
        if (
            recipe == "opsd"
            and self.teacher.hint == "student"
            and self.teacher.hint_max_new_tokens >= self.rollout.max_context_tokens
        ):
            raise ValueError(
                f"teacher.hint_max_new_tokens ({self.teacher.hint_max_new_tokens}) leaves the "
                "student no room for the hint prompt (task and attempt) within "
                f"rollout.max_context_tokens ({self.rollout.max_context_tokens}): lower it"
            )
        if self.algorithm.reward_weight > 0 and recipe not in ("opd", "opsd"):
            raise ValueError(
                f"algorithm.reward_weight adds an outcome reward to a teacher's KL (recipes "
                f"opd, opsd); recipe {recipe!r} has no KL to add it to (recipe rl trains on "
                "the reward alone)"
            )
        if self.algorithm.kl_discount > 0 and (
            recipe not in ("opd", "opsd") or self.algorithm.opd_loss != "sampled"
        ):
            raise ValueError(
                f"algorithm.kl_discount {self.algorithm.kl_discount} discounts the sampled "
                "reverse KL's advantage (recipes opd, opsd with algorithm.opd_loss: sampled); "
                f"recipe {recipe!r} with opd_loss {self.algorithm.opd_loss!r} has no such "
                "advantage (a top-k loss is a full divergence per token): set kl_discount: 0 "
                "or opd_loss: sampled"
            )
        if recipe == "opd" and self.teacher.kind == "self":
            raise ValueError(
                "recipe 'opd' needs a separate teacher (teacher.kind embedded or remote); "
                "a self-teacher with a hint is recipe 'opsd'"
            )
        if self.algorithm.opd_loss != "sampled" and self.teacher.top_k == 0:
            raise ValueError(
                f"algorithm.opd_loss '{self.algorithm.opd_loss}' needs the teacher's top-k: "
                "set teacher.top_k > 0"
            )
        layout = self.parallel
        sequence = self.rollout.max_context_tokens + self.rollout.max_new_tokens
        if layout.gpus_per_node > 0 and layout.max_tokens_per_gpu * layout.cp < sequence:
            needed = -(-sequence // layout.cp)
            raise ValueError(
                f"parallel.max_tokens_per_gpu {layout.max_tokens_per_gpu} is below (context + "
                f"generation) / cp = ({self.rollout.max_context_tokens} + "
                f"{self.rollout.max_new_tokens}) / {layout.cp}: set it to at least {needed} "
                "(or raise cp), or the longest turn cannot fit one micro-batch"
            )
        if self.rollout.max_new_tokens >= self.rollout.max_context_tokens:
            raise ValueError(
                f"rollout.max_new_tokens ({self.rollout.max_new_tokens}) must be smaller "
                f"than rollout.max_context_tokens ({self.rollout.max_context_tokens})"
            )
        return self

    @property
    def needs_teacher_topk(self) -> bool:
        """Whether the loss reads the teacher's top-k: OPD / OPSD with a top-k opd_loss,
        OPRD with the teacher_topk failure loss."""
        algorithm = self.algorithm
        if algorithm.recipe in ("opd", "opsd"):
            return algorithm.opd_loss != "sampled"
        return algorithm.recipe == "oprd" and algorithm.oprd_failure_loss == "teacher_topk"


EXTENDS = "extends"
"""A config's key naming the config it builds on (a path relative to it)."""


def load_config(path: str | Path, overrides: list[str] | None = None) -> JobConfig:
    """Read a YAML job file (with what it `extends`), apply `section.key=value` overrides,
    and validate."""
    path = Path(path)
    data = read_config_data(path)
    return config_from_dict(apply_overrides(data, overrides or []), source=str(path))


def read_config_data(path: Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The file's mapping on top of the one it extends: `extends: base.yaml` (relative to
    the file) takes the base's keys, then this file's, section by section and key by key
    (a list or a value replaces the base's; `null` sets the key to null); a base may extend
    another."""
    if not path.is_file():
        via = f" (extended by {_chain[-1]})" if _chain else ""
        raise ConfigError(f"{path}: no such config file{via}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(_yaml_problem(path, err)) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    base = data.pop(EXTENDS, None)
    if base is None:
        return data
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: {EXTENDS}: the path of the config this one builds on")
    base_path = (path.parent / base).resolve()
    chain = (*_chain, path.resolve())
    if base_path in chain:
        loop = " -> ".join(str(p) for p in (*chain, base_path))
        raise ConfigError(f"{path}: {EXTENDS} makes a loop: {loop}")
    return _merged(read_config_data(base_path, chain), data)


def _merged(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merged(merged[key], value)
        else:
            merged[key] = value
    return merged


def _yaml_problem(path: Path, err: yaml.YAMLError) -> str:
    """'FILE:LINE:COLUMN: not valid YAML: what' (PyYAML names the file '<unicode string>')."""
    mark = getattr(err, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(err, "problem", None) or str(err)
    context = getattr(err, "context", None)
    text = f"{where}: not valid YAML: {problem}" + (f" ({context})" if context else "")
    if "'\\t'" in problem:
        text += "; YAML indents with spaces, not tabs"
    return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `data` with each `a.b.c=value` set (value parsed as YAML)."""
    merged: dict[str, Any] = _deep_copy(data)
    for item in overrides:
        dotted, sep, raw = item.partition("=")
        if not sep or not dotted:
            raise ConfigError(f"override {item!r}: expected section.key=value")
        keys = dotted.split(".")
        node = merged
        for key in keys[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {key} is a value, not a section")
            node = child
        try:
            node[keys[-1]] = yaml.safe_load(raw)
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r}: value is not valid YAML: {err}") from err
    return merged


def config_from_dict(data: dict[str, Any], source: str = "config") -> JobConfig:
    try:
        return JobConfig.model_validate(data)
    except ValidationError as err:
        problems = [_describe(error) for error in err.errors()]
        raise ConfigError(f"{source}: {len(problems)} problem(s)\n" + "\n".join(problems)) from None


def config_without_refused_keys(data: dict[str, Any]) -> tuple[JobConfig, list[str]] | None:
    """The config with each key validation refuses left at its default, and those keys
    (section.key), so that the checks after validation can run in the same pass; None
    when a refusal is about a whole section or the whole config (no key to leave out)."""
    data = _deep_copy(data)
    dropped: list[str] = []
    for _ in range(20):
        try:
            return JobConfig.model_validate(data), dropped
        except ValidationError as err:
            for error in err.errors():
                loc = [str(part) for part in error["loc"]]
                section = data.get(loc[0]) if loc else None
                if len(loc) < 2 or not isinstance(section, dict) or loc[1] not in section:
                    return None
                del section[loc[1]]
                dropped.append(f"{loc[0]}.{loc[1]}")
    return None


def config_to_yaml(config: JobConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def config_to_explained_yaml(config: JobConfig, width: int = 88) -> str:
    """The config as `config_to_yaml` writes it, each key under its explanation (the
    setting's docstring) as comments: valid YAML that loads to the same config."""
    import textwrap

    data = config.model_dump(mode="json")
    lines: list[str] = []
    for name, field in type(config).model_fields.items():
        section = getattr(config, name)
        if not isinstance(section, Section):  # a top-level value (none today)
            lines += yaml.safe_dump({name: data[name]}, sort_keys=False).splitlines()
            continue
        if lines:
            lines.append("")
        if field.description:
            lines += textwrap.wrap(
                field.description, width, initial_indent="# ", subsequent_indent="# "
            )
        lines.append(f"{name}:")
        for key, info in type(section).model_fields.items():
            text = " ".join((info.description or "").split())
            if text:
                lines += textwrap.wrap(text, width, initial_indent="  # ", subsequent_indent="  # ")
            dumped = yaml.safe_dump({key: data[name][key]}, sort_keys=False)
            lines += ["  " + line for line in dumped.splitlines()]
    return "\n".join(lines) + "\n"


def _describe(error: Any) -> str:
    loc = tuple(error["loc"])
    where = ".".join(str(part) for part in loc) or "<top level>"
    if error["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        hint = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        did_you_mean = f"; did you mean '{hint[0]}'?" if hint else ""
        return f"  - {where}: unknown key{did_you_mean} (allowed: {', '.join(allowed)})"
    message = error["msg"].removeprefix("Value error, ")
    given = error.get("input")
    got = "" if isinstance(given, dict) or given is None else f" (got {given!r})"
    return f"  - {where}: {message}{got}"


def _allowed_keys(section_loc: tuple[Any, ...]) -> list[str]:
    model: type[BaseModel] = JobConfig
    for part in section_loc:
        annotation = model.model_fields[str(part)].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _deep_copy(data: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in data.items()}
