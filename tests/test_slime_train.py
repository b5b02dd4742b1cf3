"""slime's own train.py and train_async.py, whole, on this CPU machine (tests/slime_job.py).

Each run is the job `opd launch` writes (its train.py arguments, job.yaml and hook config)
for the tiny factory student, converted to torch_dist by slime's own converter, on a Ray
cluster of one loopback node with fake GPUs: slime's placement groups, its RolloutManager
actor, Megatron-LM's argument validation, get_model, checkpoint load and save, the
training loop, in train actors under the CPU runtime (slime_ext/cpu_runtime). The
rollouts are replayed (`--load-debug-rollout-data`) from files written in slime's own
format by slime's own writer, with samples made by our real generate path: slime's
generate_and_rm_group -> our generate hook -> the SGLang stand-in serving the student ->
the teacher service -> the python tool in its sandbox (the OPRD and SFT runs: our
to_samples on scripted trajectories, and our pre-tokenized SFT records).

What must hold: after 3 rollouts the job's parameters (its torch_dist checkpoint,
converted to HF by slime's tools/convert_torch_dist_to_hf.py) equal a single-process
reference to 1e-6: the same HF student, test_slime_real's plain-torch objective on each
replayed sample's logits, Adam without momentum by hand (Megatron's Adam with betas 0 and
an eps far above every gradient: the update shows the gradient's scale). A job whose loss
is doubled is caught by the same check (the negative control).

Optimizer settings are the job's `cluster.extra_train_args`, as a user would pass them.
"""

from __future__ import annotations

import asyncio
import json
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
pytest.importorskip("megatron.training.training", reason="make slime installs Megatron-LM")

from launch.plan import train_args  # noqa: E402
from slime_ext.job.config import JobConfig, config_from_dict  # noqa: E402
from slime_ext.models.factory import build_checkpoint  # noqa: E402
from tests.test_slime_real import KL_COEF, TEMPERATURE, job_dict, reference  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

ROLLOUTS = 3
LR, ADAM_EPS = 50.0, 1e3
OPTIMIZER_ARGS = [
    "--lr", str(LR), "--min-lr", str(LR), "--adam-beta1", "0", "--adam-beta2", "0",
    "--adam-eps", str(ADAM_EPS), "--clip-grad", "0", "--weight-decay", "0",
]  # fmt: skip
"""Adam without momentum, eps far above every gradient: lr * g / (|g| + eps) ~ g / 20."""
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
    """The tiny factory student, and its torch_dist checkpoint by slime's converter."""
    root = tmp_path_factory.mktemp("student")
    hf_dir = build_checkpoint("qwen3-tiny", root / "hf", seed=3)
    # as real checkpoints are (Qwen3's 151,936 rows for 151,669 tokens): the embedding
    # already a multiple of what Megatron pads to (128 x TP), so no row exists on one side only
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    model.resize_token_embeddings(PADDED_VOCAB, mean_resizing=False)
    model.save_pretrained(hf_dir)
    slime_job.convert_hf_to_torch_dist(hf_dir, root / "torch_dist", root / "convert.log")
    return Student(hf_dir, root / "torch_dist", PADDED_VOCAB)


@dataclass
class Run:
    """One whole job: its directory, job config, slime arguments and replayed samples."""

    directory: Path
    job: JobConfig
    args: list[str]
    samples: list[Any] = field(default_factory=list)


def job_for(
    student: Student, directory: Path, recipe: str, layout: tuple[int, int, int], **settings: Any
) -> JobConfig:
    """test_slime_real's job of `recipe` for this student on TP x CP x DP, the optimizer
    settings passed as a user passes extra slime arguments."""
    tp, cp, dp = layout
    data = job_dict(recipe, directory, OPTIMIZER_ARGS, settings or None)
    data["model"]["student"] = str(student.hf_dir)
    data["parallel"] |= {"gpus_per_node": tp * cp * dp, "tp": tp, "cp": cp}
    data["cluster"]["megatron_checkpoint"] = str(student.torch_dist)
    data["logging"] |= {"wandb_mode": "offline", "wandb_project": "opd-cpu-job"}
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
        *slime_job.SLIME_FLAGS,
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
                        index=group * GROUP_SIZE + i, group_index=group,
                        prompt=f"What is {group} + {i + 2}?", label=str(group + i + 2),
                    )  # fmt: skip
                    for i in range(GROUP_SIZE)
                ]
                params = {"temperature": TEMPERATURE, "max_new_tokens": 10}
                groups.append(await generate_and_rm_group(hook.args, bases, params))
            return groups

        groups = asyncio.run(rollout())
    return [s for group in groups for rollout in group for s in rollout]


# --- the reference ---------------------------------------------------------------------------


def reference_params(
    student: Student, run: Run, recipe: str, loss: str = "sampled"
) -> dict[str, torch.Tensor]:
    """The HF student trained by hand on the replayed samples, ROLLOUTS times: each step
    test_slime_real's objective on every sample's logits (over the real vocabulary),
    then Adam without momentum."""
    (run.directory / "reference").mkdir(exist_ok=True)
    args = slime_args(run.job, run.directory / "reference", vocab=student.vocab)
    model = AutoModelForCausalLM.from_pretrained(student.hf_dir, attn_implementation="eager")
    model.float().train()
    for _ in range(ROLLOUTS):
        model.zero_grad()
        logits = [model(torch.tensor([s.tokens])).logits[0] for s in run.samples]
        _, _, grads = reference(recipe, run.samples, [x.detach() for x in logits], args, loss)
        torch.autograd.backward(logits, grads)
        with torch.no_grad():
            for param in model.parameters():
                if param.grad is not None:
                    param -= LR * param.grad / (param.grad.abs() + ADAM_EPS)
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


@pytest.mark.timeout(600)
def test_train_py_tp2_per_turn_equals_the_reference_and_a_doubled_loss_does_not(
    tmp_path: Path, student: Student, cluster: Any
) -> None:
    """OPD, per-turn samples from the real generate path, TP2 x DP1 with sequence
    parallelism, slime's train.py."""
    samples = generated_samples(student, tmp_path / "rollout")
    assert len(samples) > GROUPS * GROUP_SIZE  # several turns: per-turn samples
    job = job_for(student, tmp_path / "job", "opd", (2, 1, 1))
    run = prepare(student, tmp_path / "job", job, samples)
    slime_job.train(cluster, run.args, run.directory / "train.log")
    expected = reference_params(student, run, "opd")
    initial = load_file(student.hf_dir / "model.safetensors")
    moved = max(float((expected[k] - initial[k]).abs().max()) for k in initial)
    assert moved > 1e-3  # the steps change the weights
    assert max_error(trained_params(student, run, ROLLOUTS - 1), expected) < ATOL

    doubled = prepare(student, tmp_path / "doubled", job_for(
        student, tmp_path / "doubled", "opd", (2, 1, 1)), samples)  # fmt: skip
    at = doubled.args.index("--custom-loss-function-path")
    doubled.args[at + 1] = "tests.slime_job.doubled_loss"
    slime_job.train(cluster, doubled.args, doubled.directory / "train.log")
    assert max_error(trained_params(student, doubled, ROLLOUTS - 1), expected) > 100 * ATOL
    assert KL_COEF > 0
