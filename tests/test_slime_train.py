"""slime's own train.py and train_async.py, whole, on this CPU machine (tests/slime_job.py).

Each run is the job `opd launch` writes (its train.py arguments, job.yaml and hook config)
for the tiny factory student, converted to torch_dist by slime's own converter, on a Ray
cluster of one loopback node with fake GPUs: slime's placement groups, its RolloutManager
actor, Megatron-LM's argument validation, get_model, checkpoint load and save, the
training loop, in train actors under the CPU runtime (slime_ext/cpu_runtime). The
rollouts are replayed (`--load-debug-rollout-data`) from files written in slime's own
format by slime's own writer. The per-turn OPD run's samples come from our real generate
path: slime's generate_and_rm_group -> our generate hook -> the SGLang stand-in serving
the student -> the teacher service -> the python tool in its sandbox. The tree-packed and
OPRD runs' come from our to_samples on scripted trajectories (with a teacher's top-k), the
SFT run's from our pre-tokenized records through our SFT rollout.

What must hold: after 3 rollouts the job's parameters (its torch_dist checkpoint,
converted to HF by slime's tools/convert_torch_dist_to_hf.py) equal a single-process
reference to 1e-6: the same HF student, test_slime_real's plain-torch objective on each
replayed sample's logits (tree-packed samples: on the same trajectories' per-turn
samples), torch's Adam (an eps far above every gradient: the update shows the gradient's
scale). Negative control: the job misses the reference of a doubled loss (what the
comparison resolves). A packed job whose trees are lost is refused (test_slime_tree, by the
check the job's train actors install).

Optimizer settings are the job's `cluster.extra_train_args`, as a user would pass them.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests import slime_job
from tests.slime_driver import require_slime, slime_args

require_slime()
_training = importlib.util.find_spec("megatron.training")
if _training is None or _training.origin is None:  # absent, or slime_cpu's stand-in
    reason = "Megatron-LM's training package is not installed: `make slime` installs it"
    if os.environ.get("CI"):
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason, allow_module_level=True)

from launch.plan import train_args  # noqa: E402
from slime_ext.cpu_runtime import SLIME_FLAGS  # noqa: E402
from slime_ext.job.config import JobConfig, config_from_dict  # noqa: E402
from slime_ext.models.factory import build_checkpoint  # noqa: E402
from tests.test_slime_real import TEMPERATURE, job_dict, reference  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

ROLLOUTS = 3
ADAM_EPS = 1e3
LR = {"opd": 50.0, "opd topk": 1e4, "oprd": 5.0, "sft": 5.0}
"""The learning rate of each case (optimizer_args)."""
BETAS = (0.9, 0.999)


def optimizer_args(lr: float) -> list[str]:
    """Adam with an eps far above every gradient: each update is about lr * m / eps, so it
    shows the gradient's scale (Adam's usual first steps, g / |g|, would hide it), and its
    moments must survive a resume. `lr` per recipe: the weights move by 1e-3 to 1e-1 in 3
    steps, so that 1e-6 is fp32's agreement, not a small step's."""
    return [
        "--lr", str(lr), "--min-lr", str(lr), "--adam-beta1", str(BETAS[0]),
        "--adam-beta2", str(BETAS[1]), "--adam-eps", str(ADAM_EPS), "--clip-grad", "0",
        "--weight-decay", "0",
    ]  # fmt: skip


ATOL = 1e-6
PADDED_VOCAB = 2304
"""The student's vocab_size: the factory tokenizer's 2,054 ids padded to 9 x 256."""
GROUPS, GROUP_SIZE = 3, 2
"""Rollouts of a step: tasks x samples (the job's tasks_per_step x samples_per_task)."""


@dataclass
class Student:
    hf_dir: Path
    torch_dist: Path
    vocab: int
    """Its embedding's rows (config.json's vocab_size)."""


@pytest.fixture(scope="module")
def student(tmp_path_factory: pytest.TempPathFactory) -> Student:
    return make_student(tmp_path_factory.mktemp("student"))


def make_student(root: Path, vocab: int | None = PADDED_VOCAB) -> Student:
    """The tiny factory student, its embedding padded to `vocab` rows (None: one row per
    token), and its torch_dist checkpoint by slime's converter."""
    hf_dir = build_checkpoint("qwen3-tiny", root / "hf", seed=3)
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    if vocab is not None:
        # as real checkpoints are (Qwen3's 151,936 rows for 151,669 tokens): the embedding
        # already a multiple of what Megatron pads to (128 x TP), so no row exists on one
        # side only
        model.resize_token_embeddings(vocab, mean_resizing=False)
        model.save_pretrained(hf_dir)
    slime_job.convert_hf_to_torch_dist(hf_dir, root / "torch_dist", root / "convert.log")
    return Student(hf_dir, root / "torch_dist", model.config.vocab_size)


@dataclass
class Run:
    """One whole job: its directory, job config, slime arguments and replayed samples."""

    directory: Path
    job: JobConfig
    args: list[str]
    samples: list[Any] = field(default_factory=list)


def job_for(
    student: Student,
    directory: Path,
    recipe: str,
    layout: tuple[int, int, int],
    colocate: bool = True,
    lr: float = LR["opd"],
    save_every_steps: int = 10,
    teacher: dict[str, Any] | None = None,
    **settings: Any,
) -> JobConfig:
    """test_slime_real's job of `recipe` for this student on TP x CP x DP (`teacher` in
    place of its teacher section), the optimizer settings passed as a user passes extra
    slime arguments."""
    tp, cp, dp = layout
    data = job_dict(recipe, directory, optimizer_args(lr), settings or None)
    data["model"]["student"] = str(student.hf_dir)
    data["teacher"] = teacher or data["teacher"]
    data["parallel"] |= {
        "gpus_per_node": tp * cp * dp, "tp": tp, "cp": cp, "colocate": colocate,
        **({} if colocate else {"rollout_gpus": 1}),
        # two or three samples a micro-batch: slime's DP schedule cannot split one-sample
        # micro-batches evenly over DP 2 (test_megatron_step's MAX_TOKENS_PER_GPU)
        "max_tokens_per_gpu": 640,
    }  # fmt: skip
    data["cluster"]["megatron_checkpoint"] = str(student.torch_dist)
    data["logging"] |= {
        "wandb_mode": "offline", "wandb_project": "opd-cpu-job",
        "save_every_steps": save_every_steps,
    }  # fmt: skip
    return config_from_dict(data)


def prepare(student: Student, directory: Path, job: JobConfig, samples: list[Any]) -> Run:
    """Write what `opd launch` writes (job.yaml, the hook config), the tasks file the data
    source reads, and the replay; the train.py arguments (MODEL_ARGS first, as slime's run
    scripts pass them; the CPU runtime's settings; the CPU layer spec)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "job.yaml").write_text(yaml.safe_dump(job.model_dump(mode="json")))
    hooks = {"opd_job_config": str(directory / "job.yaml")}
    (directory / "hooks.yaml").write_text(yaml.safe_dump(hooks))
    row = {"prompt": "What is 2 + 3?", "label": "5", "metadata": {}}
    Path(str(job.cluster.tasks_file)).write_text(json.dumps(row) + "\n")
    template = slime_job.save_replay(directory / "replay", [samples] * ROLLOUTS)
    args = [
        *slime_job.model_args(student.hf_dir),
        *SLIME_FLAGS,
        *slime_job.cpu_spec(train_args(job, str(directory / "hooks.yaml"))),
        "--load-debug-rollout-data", template,
        "--num-rollout", str(ROLLOUTS),
    ]  # fmt: skip
    return Run(directory, job, args, samples)


# --- the samples: our real generate path --------------------------------------------------


def generated_samples(student: Student, directory: Path, top_k: int = 0) -> list[Any]:
    """One step's rollouts by slime's generate_and_rm_group through our generate and reward
    hooks: the student served by the SGLang stand-in, a teacher service (another factory
    model), the python tool in its sandbox; flattened as slime's RolloutManager flattens."""
    from slime.rollout.sglang_rollout import GenerateState, generate_and_rm_group
    from slime.utils.types import Sample

    from teacher_server.hf_backend import HFBackend
    from teacher_server.metrics import ServerMetrics
    from tests.test_slime_hooks import _served_hook

    teacher_dir = build_checkpoint("qwen3-tiny", directory / "teacher", seed=8)
    backend = HFBackend(teacher_dir, ServerMetrics(), max_context=4096)
    model = AutoModelForCausalLM.from_pretrained(student.hf_dir).eval()
    teacher = {"kind": "remote", **({"top_k": top_k} if top_k else {})}
    with _served_hook(
        backend, student.hf_dir, directory, teacher=teacher, max_turns=3, max_new_tokens=10,
        student=model,
    ) as hook:  # fmt: skip

        async def rollout() -> list[Any]:
            GenerateState.clear_instances()
            groups = []
            for group in range(GROUPS):
                bases = [
                    Sample(
                        index=group * GROUP_SIZE + i,
                        group_index=group,
                        prompt=f"What is {group} + {i + 2}?",
                        label=str(group + i + 2),
                    )
                    for i in range(GROUP_SIZE)
                ]
                params = {"temperature": TEMPERATURE, "max_new_tokens": 10}
                groups.append(await generate_and_rm_group(hook.args, bases, params))
            return groups

        groups = asyncio.run(rollout())
    return [s for group in groups for rollout in group for s in rollout]


# --- the reference ---------------------------------------------------------------------------


def reference_params(
    student: Student, run: Run, recipe: str, samples: list[Any] | None = None,
    loss: str = "sampled", scale: float = 1.0,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """The HF student trained in this process on the replayed samples (or their per-turn
    twins), ROLLOUTS steps: test_slime_real's objective (times `scale`) on every sample's
    logits, then torch's Adam with the job's settings (every parameter stepped, as
    Megatron's distributed optimizer steps them)."""
    (run.directory / "reference").mkdir(exist_ok=True)
    args = slime_args(run.job, run.directory / "reference", vocab=student.vocab)
    samples = run.samples if samples is None else samples
    model = AutoModelForCausalLM.from_pretrained(student.hf_dir, attn_implementation="eager")
    model.float().train()
    extra = run.job.cluster.extra_train_args  # optimizer_args, as the job passed them
    lr = float(extra[extra.index("--lr") + 1])
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=BETAS, eps=ADAM_EPS)
    for _ in range(ROLLOUTS):
        optimizer.zero_grad(set_to_none=False)
        logits = [model(torch.tensor([s.tokens])).logits[0] for s in samples]
        _, _, grads = reference(recipe, samples, [x.detach() for x in logits], args, loss)
        torch.autograd.backward(logits, [g * scale for g in grads])
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def trained_params(student: Student, run: Run, iteration: int) -> dict[str, torch.Tensor]:
    """The job's checkpoint of `iteration`, converted to HF by slime's converter."""
    out = run.directory / f"hf_iter_{iteration}"
    slime_job.convert_torch_dist_to_hf(
        Path(str(run.job.cluster.save_dir)) / f"iter_{iteration:07d}", out, student.hf_dir,
        student.vocab, run.directory / "convert_to_hf.log",
    )  # fmt: skip
    params: dict[str, torch.Tensor] = {}
    for shard in sorted(out.glob("*.safetensors")):
        params |= load_file(shard)
    return params


def max_error(trained: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    names = set(trained) - {"lm_head.weight"}  # tied to the embedding
    assert names <= set(expected), names - set(expected)
    return max(float((trained[k] - expected[k]).abs().max()) for k in names)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One loopback Ray node with 2 fake GPUs for the module's jobs (one at a time)."""
    root = Path(tmp_path_factory.mktemp("r", numbered=True))
    with slime_job.cpu_cluster(root, gpus=2) as running:
        yield running


def scripted_samples(
    recipe: str, directory: Path, job: JobConfig, student: Student, layout: str = "per_turn"
) -> list[Any]:
    """test_slime_real's rollout step of `recipe` (our to_samples on scripted trajectories
    with a teacher's top-k; sft: our pre-tokenized records through our SFT rollout),
    flattened as slime's RolloutManager flattens it."""
    from slime_ext.models.factory import build_tokenizer
    from tests.test_slime_real import rollout_groups, scripted_with_topk

    directory.mkdir(parents=True, exist_ok=True)
    args = slime_args(job, directory, vocab=student.vocab)
    trajectories = scripted_with_topk(build_tokenizer())
    [step, *_] = rollout_groups(recipe, args, directory, trajectories, layout=layout)
    return [s for group in step for rollout in group for s in rollout]


def assert_trained_as_reference(
    student: Student, run: Run, recipe: str, expected: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The job moved the weights and ended where the reference did; its parameters."""
    initial = load_file(student.hf_dir / "model.safetensors")
    moved = max(float((expected[k] - initial[k]).abs().max()) for k in initial)
    assert moved > 1e-3  # the steps change the weights
    trained = trained_params(student, run, ROLLOUTS - 1)
    error = max_error(trained, expected)
    assert error < ATOL, (recipe, error)
    return trained


def wandb_keys(run: Run) -> bytes:
    """The offline W&B run's records (its history keys are in them as text)."""
    files = list((Path(str(run.job.logging.run_dir)) / "wandb").rglob("run-*.wandb"))
    assert files, "no offline W&B run in the job's run directory"
    return b"".join(f.read_bytes() for f in files)


@pytest.mark.timeout(600)
def test_train_py_tp2_per_turn_equals_the_reference_and_a_doubled_loss_does_not(
    tmp_path: Path, student: Student, cluster: Any
) -> None:
    """OPD, per-turn samples from the real generate path, TP2 x DP1 with sequence
    parallelism, slime's train.py; slime's and our metrics per rollout in the console and
    an offline W&B run. The same job's parameters miss the reference of a doubled loss:
    the comparison resolves the loss's scale (a job that trained on another objective, or
    on the right one at another scale, fails it)."""
    samples = generated_samples(student, tmp_path / "rollout")
    assert len(samples) > GROUPS * GROUP_SIZE  # several turns: per-turn samples
    run = prepare(
        student, tmp_path / "job", job_for(student, tmp_path / "job", "opd", (2, 1, 1)), samples
    )
    slime_job.train(cluster, run.args, run.directory / "train.log")
    expected = reference_params(student, run, "opd")
    trained = assert_trained_as_reference(student, run, "opd", expected)

    console = (run.directory / "train.log").read_text(errors="replace")
    for rollout_id in range(ROLLOUTS):  # ours, per rollout (slime logs none of a replay)
        assert f"opd rollout {rollout_id}: " in console
    assert console.count("'train/opd_reverse_kl'") >= ROLLOUTS  # slime's train log, ours in it
    records = wandb_keys(run)
    for key in (b"rollout/num_turns", b"rollout/opd_reverse_kl", b"train/opd_reverse_kl",
                b"train/grad_norm", b"perf/processed_tokens_per_loss_token"):  # fmt: skip
        assert key in records, key

    doubled = reference_params(student, run, "opd", scale=2.0)
    assert max_error(trained, doubled) > 100 * ATOL


@pytest.mark.timeout(600)
def test_train_async_py_tree_packed_topk_on_cp2_equals_the_per_turn_reference(
    tmp_path: Path, student: Student, cluster: Any
) -> None:
    """OPD with the teacher's top-k (topk_tail), tree-packed samples (one per trajectory,
    the tree attention in every layer), TP1 x CP2, slime's train_async.py; the reference
    trains on the same trajectories' per-turn samples."""
    directory = tmp_path / "job"
    settings = {"opd_loss": "topk_tail", "sequence_layout": "packed"}
    # train_async.py refuses colocated engines (train_async.py:11)
    job = job_for(
        student, directory, "opd", (1, 2, 1), colocate=False, lr=LR["opd topk"], **settings
    )
    packed = scripted_samples("opd", tmp_path / "packed", job, student, layout="packed")
    per_turn = scripted_samples("opd", tmp_path / "per_turn", job, student)
    assert len(packed) < len(per_turn)
    run = prepare(student, directory, job, packed)
    assert run.args[run.args.index("--spec") + 1 :][:2] == [
        "slime_ext.cpu_runtime.spec", "tree_layer_spec",
    ]  # fmt: skip
    slime_job.train(cluster, run.args, directory / "train.log", script="train_async.py")
    expected = reference_params(student, run, "opd", per_turn, loss="topk_tail")
    assert_trained_as_reference(student, run, "opd", expected)


@pytest.mark.timeout(600)
def test_train_py_oprd_on_dp2_equals_the_reference(
    tmp_path: Path, student: Student, cluster: Any
) -> None:
    """OPRD (its branch shares through our advantage hook, success NLL and failure KL),
    per-turn samples, TP1 x DP2 (one trajectory's turns on both ranks), slime's train.py."""
    directory = tmp_path / "job"
    job = job_for(student, directory, "oprd", (1, 1, 2), lr=LR["oprd"])
    run = prepare(student, directory, job, scripted_samples("oprd", tmp_path / "s", job, student))
    assert "--custom-advantage-function-path" in run.args
    slime_job.train(cluster, run.args, directory / "train.log")
    assert_trained_as_reference(student, run, "oprd", reference_params(student, run, "oprd"))


@pytest.mark.timeout(600)
def test_sft_job_killed_after_rollout_1_and_launched_again_ends_as_the_reference(
    tmp_path: Path, student: Student, cluster: Any
) -> None:
    """SFT on pre-tokenized turns, TP2 x DP1, slime's train.py, saving every rollout:
    killed once rollout 1's checkpoint is saved (slime's save_model) and launched again as
    it was (--load), the job goes on from rollout 2 and ends where the uninterrupted
    reference does (Adam's moments and the LR schedule restored: a resume that lost them
    misses it). Its checkpoint converted to HF gives Megatron's logits on a prompt: the
    checkpoint loaded by Megatron-LM at TP1."""
    directory = tmp_path / "job"
    job = job_for(student, directory, "sft", (2, 1, 1), lr=LR["sft"], save_every_steps=1)
    samples = scripted_samples("sft", tmp_path / "s", job, student)
    run = prepare(student, directory, job, samples)
    tracker = Path(str(job.cluster.save_dir)) / "latest_checkpointed_iteration.txt"

    def saved_rollout_1() -> bool:
        return tracker.exists() and tracker.read_text().strip() == str(ROLLOUTS - 2)

    slime_job.train_until_killed(cluster, run.args, directory / "first.log", saved_rollout_1)
    assert tracker.read_text().strip() == str(ROLLOUTS - 2)  # killed before rollout 2 saved
    slime_job.train(cluster, run.args, directory / "second.log")
    second = (directory / "second.log").read_text(errors="replace")
    assert "'train/step': 2" in second and "'train/step': 1" not in second  # went on
    assert_trained_as_reference(student, run, "sft", reference_params(student, run, "sft"))

    # the HF model slime's converter made (docs/evaluation.md's path to evaluate a trained
    # checkpoint) gives Megatron's logits
    prompt = samples[0].tokens[:24]
    megatron = slime_job.megatron_logits(
        student.hf_dir, Path(str(job.cluster.save_dir)), prompt, directory / "logits.pt",
        directory / "forward.log",
    )  # fmt: skip
    converted = AutoModelForCausalLM.from_pretrained(directory / f"hf_iter_{ROLLOUTS - 1}")
    with torch.no_grad():
        hf = converted.float().eval()(torch.tensor([prompt])).logits[0]
    assert megatron.shape == hf.shape
    assert float((megatron - hf).abs().max()) < 1e-5
    assert torch.equal(megatron.argmax(-1), hf.argmax(-1))  # the same greedy tokens
