"""slime flags that `cluster.extra_train_args` may not carry, each with why and the fix.

The plan (launch/plan.py, train_args) appends `cluster.extra_train_args` to the arguments
it derives from the job config. slime's parsers keep a flag's last value, and its Megatron
phase drops flags it does not know (megatron_parse_args with ignore_unknown_args), so a
flag given there silently wins. Refused here: flags that would replace our hooks, that
restate a value the plan derives from the config, and those that change what reaches our
hooks in a way they cannot honour (THUDM/slime at the pinned commit; flags defined in
slime/utils/arguments.py). Flags not named pass through (Megatron memory and recompute
settings, SGLang server settings, --use-rollout-logprobs, --keep-old-actor, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from slime_ext.job.config import JobConfig

SAMPLED_ON_SLIME = ("opd", "opsd", "oprd", "rl")
"""Recipes whose rollouts our generate hook samples through slime's SGLang router (sft and
ssd train on pre-tokenized data: slime samples nothing)."""
ROUTER_POLICY = "manual"
"""The router policy the plan passes for SAMPLED_ON_SLIME recipes. Our rollout policy sends
`X-SMG-Routing-Key` (one key per trajectory) so that a trajectory's turns reuse one rollout
engine's prefix cache; the SGLang router honours the key under `manual` (sticky: a key
moves only when its worker fails) and `consistent_hashing`, not under slime's default
`cache_aware`. sglang-router 0.3.2's CLI (router_args.py, --router-policy choices) does not
offer consistent_hashing: slime would exit on it while parsing its arguments."""
ROUTING_KEY_POLICIES = ("manual", "consistent_hashing")
TOP_P_BELOW_ONE = (
    "with a top-p below 1 slime asserts that every sample carries its kept top-p token sets "
    "(rollout_top_p_token_ids / offsets, filled only by slime's own SGLang generate; "
    "slime/ray/rollout.py) and recomputes log-probs on them; our per-turn samples carry "
    "none, and our losses use the untruncated distribution (the sampled reverse KL is "
    "on-policy only for top_p 1)"
)
"""Why top-p truncation is refused on slime (the plan's check and the hooks' share it)."""
RPP_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")

Given = Mapping[str, str | None]
"""The flags of extra_train_args: each flag's last value (None: a switch)."""
When = Callable[[JobConfig, str | None, Given], bool]


def _always(job: JobConfig, value: str | None, given: Given) -> bool:
    return True


OPRD_REFUSED_FLAGS = {
    "normalize_advantages": "--normalize-advantages would whiten the branch shares",
    "use_opd": "--use-opd would subtract slime's own OPD penalty from the branch shares",
    "use_critic": "--use-critic would train a critic on the branch shares",
    "calculate_per_token_loss": (
        "--calculate-per-token-loss would average tokens, while the branch shares weight "
        "slime's per-rollout means"
    ),
}
"""slime flags that would rewrite or misread the branch shares the OPRD advantage hook
(slime_ext.slime.oprd) sets; it refuses them, and so does the plan."""


@dataclass(frozen=True)
class RefusedFlag:
    flag: str
    why: str
    """The reason and the fix, as the refusal prints them."""
    when: When = _always
    """Whether this job and value are refused."""


def _packed(job: JobConfig, value: str | None, given: Given) -> bool:
    """Whether the job trains tree-packed samples (its resolved sequence layout)."""
    from slime_ext.job.sequence_layout import resolve

    return resolve(job).layout == "packed"


CPU_TREE_SPEC = "slime_ext.cpu_runtime.spec"
"""The CPU runtime's spec module (a rehearsal's): its tree_layer_spec builds the plan's tree
attention spec with the CPU runtime's layers, so a packed job may name it."""


def _packed_other_spec(job: JobConfig, value: str | None, given: Given) -> bool:
    return value != CPU_TREE_SPEC and _packed(job, value, given)


def _sampled(job: JobConfig, value: str | None, given: Given) -> bool:
    return job.algorithm.recipe in SAMPLED_ON_SLIME


def _pretokenized(job: JobConfig, value: str | None, given: Given) -> bool:
    return not _sampled(job, value, given)


def _nonzero(job: JobConfig, value: str | None, given: Given) -> bool:
    try:
        return value is None or float(value) != 0.0
    except ValueError:
        return True


def _kl_coef_unused(job: JobConfig, value: str | None, given: Given) -> bool:
    rl_with_kl = (
        job.algorithm.recipe == "rl" and given.get("--advantage-estimator") in RPP_ESTIMATORS
    )
    return _nonzero(job, value, given) and not rl_with_kl


def _estimator_unused(job: JobConfig, value: str | None, given: Given) -> bool:
    allowed = ("grpo", *RPP_ESTIMATORS) if job.algorithm.recipe == "rl" else ("grpo",)
    return value not in allowed and not _ppo(job, value, given)


def _ppo(job: JobConfig, value: str | None, given: Given) -> bool:
    return value == "ppo"


def _no_routing_key(job: JobConfig, value: str | None, given: Given) -> bool:
    return _sampled(job, value, given) and value not in ROUTING_KEY_POLICIES


def _slime_filter(job: JobConfig, value: str | None, given: Given) -> bool:
    return _sampled(job, value, given) and (value or "").startswith("slime.")


PLAN_DERIVED: dict[str, str] = {
    "--actor-num-nodes": "parallel.num_nodes",
    "--actor-num-gpus-per-node": "parallel.gpus_per_node",
    "--rollout-num-gpus-per-engine": "parallel.rollout_gpus_per_engine",
    "--colocate": "parallel.colocate",
    "--rollout-num-gpus": "parallel.rollout_gpus",
    "--tensor-model-parallel-size": "parallel.tp",
    "--context-parallel-size": "parallel.cp",
    "--pipeline-model-parallel-size": "parallel.pp",
    "--expert-model-parallel-size": "parallel.ep",
    "--expert-tensor-parallel-size": "parallel.etp",
    "--max-tokens-per-gpu": "parallel.max_tokens_per_gpu",
    "--hf-checkpoint": "model.student",
    "--ref-load": "cluster.megatron_checkpoint",
    "--load": "cluster.save_dir",
    "--save": "cluster.save_dir",
    "--save-interval": "logging.save_every_steps",
    "--num-rollout": "algorithm.steps",
    "--rollout-batch-size": "rollout.tasks_per_step",
    "--n-samples-per-prompt": "rollout.samples_per_task",
    "--global-batch-size": "rollout.tasks_per_step and rollout.samples_per_task",
    "--num-steps-per-rollout": "rollout.tasks_per_step (one optimizer step per rollout)",
    "--rollout-max-response-len": "rollout.max_new_tokens",
    "--rollout-temperature": "rollout.temperature",
    "--rollout-top-p": "rollout.top_p",
    "--rollout-top-k": "rollout.top_k",
    "--prompt-data": "cluster.tasks_file",
    "--input-key": "cluster.tasks_file (rows {prompt, label, metadata: {task}})",
    "--label-key": "cluster.tasks_file (rows {prompt, label, metadata: {task}})",
    "--metadata-key": "cluster.tasks_file (rows {prompt, label, metadata: {task}})",
    "--lr": "algorithm.lr",
    "--lr-decay-style": "algorithm.lr_schedule",
    "--lr-warmup-iters": "algorithm.lr_warmup_steps",
    "--lr-decay-iters": "algorithm.steps (cosine and linear decay over the whole run)",
    "--min-lr": "algorithm.min_lr",
    "--lr-warmup-fraction": "algorithm.lr_warmup_steps (slime lets it override the iters)",
    "--lr-warmup-init": "algorithm.lr_warmup_steps (warmup starts at 0, as locally)",
    "--weight-decay": "algorithm.weight_decay",
    "--clip-grad": "algorithm.grad_clip",
    "--use-wandb": "logging.wandb_mode",
    "--wandb-project": "logging.wandb_project",
    "--wandb-group": "logging.wandb_group",
    "--wandb-team": "logging.wandb_entity",
}
"""Flags whose value the plan derives from the config: the config key to set instead."""

PLAN_HOOKS = (
    "--loss-type",
    "--custom-loss-function-path",
    "--custom-generate-function-path",
    "--custom-rm-path",
    "--custom-reward-post-process-path",
    "--rollout-function-path",
    "--custom-advantage-function-path",
    "--custom-config-path",
    "--custom-rollout-log-function-path",
    "--disable-compute-advantages-and-returns",
)
"""Flags the plan points at our hooks (slime_ext.slime) as algorithm.recipe needs."""

POLICY_LOSS_ONLY = (
    "--use-kl-loss",
    "--kl-loss-coef",
    "--entropy-coef",
    "--use-tis",
    "--custom-tis-function-path",
    "--eps-clip-c",
    "--use-opsm",
    "--custom-pg-loss-reducer-function-path",
)
"""Terms slime adds inside its own policy_loss (megatron_utils/loss.py)."""

SAMPLING_PARAMS_ONLY = (
    "--rollout-stop",
    "--rollout-stop-token-ids",
    "--eval-temperature",
    "--eval-top-p",
    "--eval-top-k",
    "--eval-max-response-len",
)
"""Flags that reach only the `sampling_params` slime hands a generate function."""

REFUSED: tuple[RefusedFlag, ...] = (
    *(
        RefusedFlag(
            flag,
            "recipes sft and ssd train on pre-tokenized data: slime samples nothing, so it "
            "would change nothing, except that a top-p below 1 makes slime assert kept top-p "
            "token sets on every sample (slime/ray/rollout.py), which ours lack: drop it",
            _pretokenized,
        )
        for flag in ("--rollout-top-p", "--rollout-top-k")
    ),
    *(
        RefusedFlag(
            flag,
            f"the plan sets it from {key}; a second value would override the config "
            f"(slime keeps the last): set {key} instead",
        )
        for flag, key in PLAN_DERIVED.items()
    ),
    *(
        RefusedFlag(
            flag,
            "the plan points it at our hooks (slime_ext.slime, as algorithm.recipe needs); "
            "another value would silently replace them: drop it",
        )
        for flag in PLAN_HOOKS
    ),
    *(
        RefusedFlag(
            flag,
            "the plan sets it for tree-packed samples (algorithm.sequence_layout resolved to "
            "packed): the tree attention in every layer's spec, RoPE applied inside it at "
            "each token's position, the trees carried to it; another value would train "
            "packed samples with causal attention, a silently wrong objective. Set "
            "algorithm.sequence_layout: per_turn to use your own",
            _packed,
        )
        for flag in ("--position-embedding-type", "--custom-megatron-init-path")
    ),
    RefusedFlag(
        "--spec",
        "the plan sets it for tree-packed samples (algorithm.sequence_layout resolved to "
        "packed): the tree attention in every layer's spec (slime's Gated DeltaNet layers "
        "taking the tree in a hybrid's), RoPE applied inside it at each token's position; "
        "another spec would train packed samples with causal attention, a silently wrong "
        "objective. Set algorithm.sequence_layout: per_turn to use your own",
        _packed_other_spec,
    ),
    RefusedFlag(
        "--custom-megatron-init-path",
        "the plan sets it so that the teacher's top-k reaches the loss (slime_ext.slime.tree "
        ".init installs that extension of slime's data path); another function would leave "
        "the loss without it: drop it",
        lambda job, value, given: job.needs_teacher_topk,
    ),
    RefusedFlag(
        "--custom-convert-samples-to-train-data-path",
        "it replaces slime's conversion of samples to train data, which carries the rollout "
        "ids, per-rollout loss-mask sums and teacher_log_probs our loss reads: drop it",
    ),
    RefusedFlag(
        "--group-rm",
        "slime then rewards each group at once and sets `.reward` on its members "
        "(rollout/sglang_rollout.py, generate_and_rm_group), which are lists of per-turn "
        "samples here: AttributeError. Our generate hook already gives every sample its "
        "trajectory's reward and our post-process normalizes per group: drop it",
    ),
    RefusedFlag(
        "--allgather-cp",
        "slime then splits the concatenated batch contiguously over CP ranks "
        "(megatron_utils/data.py, loss.py get_responses); our loss reads each sample's "
        "zigzag CP layout (slime_ext/slime/cp.py) and would pair logits with the wrong "
        "tokens, a silently wrong objective: drop it",
    ),
    RefusedFlag(
        "--calculate-per-token-loss",
        "slime's reducer then averages over all loss tokens of a step, weighting long "
        "trajectories more; every recipe here is normalized per trajectory (DESIGN.md "
        "invariant 7: slime's per-rollout means): drop it",
    ),
    RefusedFlag(
        "--use-opd",
        "slime's own OPD (a KL penalty on the advantages, from a teacher it queries itself) "
        "would come on top of our per-turn distillation from teacher.url: drop it",
    ),
    RefusedFlag(
        "--partial-rollout",
        "slime then recycles unfinished groups into its buffer, reading `.response` on each "
        "member (rollout/sglang_rollout.py, abort), a list of per-turn samples here "
        "(AttributeError); our generate hook runs a whole trajectory per call and cannot "
        "resume one: drop it",
    ),
    RefusedFlag(
        "--use-rollout-routing-replay",
        "slime then needs each sample's rollout_routed_experts, which only its own SGLang "
        "generate fills (megatron_utils/actor.py raises without them); our samples carry "
        "none: use --use-routing-replay (routes recorded in the log-prob pass) instead",
    ),
    RefusedFlag(
        "--reward-key",
        "slime then reads sample.reward[key] (Sample.get_reward_value); our hooks set one "
        "float reward per trajectory: drop it",
    ),
    RefusedFlag(
        "--dynamic-sampling-filter-path",
        "slime's filters (slime.rollout.filter_hub) read one Sample's reward per group "
        "member; our generate hook's members are lists of per-turn samples "
        "(AttributeError): use a filter that takes lists, or none",
        _slime_filter,
    ),
    RefusedFlag(
        "--advantage-estimator",
        "ppo trains a critic (slime sets use_critic) whose values our losses never read, and "
        "its GAE advantages replace the per-trajectory ones: keep the plan's grpo (rl: or "
        "reinforce_plus_plus[_baseline])",
        _ppo,
    ),
    RefusedFlag(
        "--advantage-estimator",
        "it would change nothing: gspo and cispo differ from grpo only inside slime's "
        "policy_loss, which our custom loss replaces, and the loss of recipes other than rl "
        "reads no estimator's advantages (oprd: our advantage function sets them); keep the "
        "plan's grpo (rl: or reinforce_plus_plus[_baseline])",
        _estimator_unused,
    ),
    RefusedFlag(
        "--kl-coef",
        "this is slime's reward-shaping KL to the reference model, not algorithm.kl_coef "
        "(the weight of our KL to the teacher): only reinforce_plus_plus[_baseline] "
        "advantages use it (rl), our other losses never read it, and the reference model "
        "would still be loaded and run each step. Set algorithm.kl_coef, or for rl pass "
        "--advantage-estimator reinforce_plus_plus with it",
        _kl_coef_unused,
    ),
    *(
        RefusedFlag(
            flag,
            "slime applies it inside its own policy_loss only; under --loss-type custom_loss "
            "(our loss) it would be silently ignored: drop it",
            _nonzero if flag.endswith("-coef") else _always,
        )
        for flag in POLICY_LOSS_ONLY
    ),
    *(
        RefusedFlag(
            flag,
            "it reaches only the sampling_params slime passes to a generate function; ours "
            "samples every turn (evaluation too) with the job's rollout.* settings and the "
            "harness's stop tokens, so it would be silently ignored: drop it",
        )
        for flag in SAMPLING_PARAMS_ONLY
    ),
    *(
        RefusedFlag(
            flag,
            "our rollout policy keeps a trajectory on one rollout engine's prefix cache with "
            "the X-SMG-Routing-Key header, which the SGLang router honours only under policy "
            "manual or consistent_hashing (slime's default is cache_aware): use "
            f"{flag} manual, or drop it (the plan passes --router-policy {ROUTER_POLICY})",
            _no_routing_key,
        )
        for flag in ("--router-policy", "--router-prefill-policy", "--router-decode-policy")
    ),
)
"""Every refusal of cluster.extra_train_args; a flag may have several, the first that
applies is reported. Recipe oprd adds OPRD_REFUSED_FLAGS."""


def given_flags(argv: Sequence[str]) -> dict[str, str | None]:
    """Each `--flag` of argv with its last value: `--flag value`, `--flag=value`, or None
    for a switch (the next token is another flag, or none)."""
    given: dict[str, str | None] = {}
    for index, token in enumerate(argv):
        if not token.startswith("--"):
            continue
        flag, sep, value = token.partition("=")
        if sep:
            given[flag] = value
            continue
        following = argv[index + 1] if index + 1 < len(argv) else None
        given[flag] = None if following is None or following.startswith("--") else following
    return given


def _oprd_refusals() -> tuple[RefusedFlag, ...]:
    """The flags the OPRD advantage hook refuses, with its reasons."""
    return tuple(
        RefusedFlag(
            "--" + attribute.replace("_", "-"),
            f"recipe oprd: {why} (slime_ext/slime/oprd.py): drop it",
        )
        for attribute, why in OPRD_REFUSED_FLAGS.items()
    )


def extra_args_problems(job: JobConfig) -> list[str]:
    """A line per refused flag of cluster.extra_train_args, with why and the fix."""
    given = given_flags(job.cluster.extra_train_args)
    if not given:
        return []
    refusals = REFUSED + (_oprd_refusals() if job.algorithm.recipe == "oprd" else ())
    problems = []
    for flag, value in given.items():
        refusal = next((r for r in refusals if r.flag == flag and r.when(job, value, given)), None)
        if refusal is not None:
            shown = flag if value is None else f"{flag} {value}"
            problems.append(f"cluster.extra_train_args {shown}: {refusal.why}")
    return problems


def router_policy_args(job: JobConfig) -> list[str]:
    """`--router-policy manual` for recipes our generate hook samples, unless
    cluster.extra_train_args sets the policy (to one extra_args_problems accepts)."""
    if job.algorithm.recipe not in SAMPLED_ON_SLIME:
        return []
    if "--router-policy" in given_flags(job.cluster.extra_train_args):
        return []
    return ["--router-policy", ROUTER_POLICY]


def refusal_reason(flag: str) -> str:
    """The reason (and fix) REFUSED gives for `flag` (the hooks repeat it at run time)."""
    return next(refused.why for refused in REFUSED if refused.flag == flag)
