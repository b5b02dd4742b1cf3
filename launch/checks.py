"""The checks a command makes before it starts, beyond what the config's own validation
says: `opd launch` (the cluster path) and `opd train` (the local trainer). `opd config
validate` runs the same functions as the command the config is for."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from launch.plan import check_cluster, hosts_from_config
from slime_ext.job.config import ConfigError, JobConfig
from teacher_server.backend import tokenizer_identity, vocab_digest

LAUNCH = "opd launch"
SBATCH = "opd launch --sbatch"
TRAIN = "opd train"


def command_for(job: JobConfig) -> str:
    """The command a config is for: a cluster job (GPUs per node), as a Slurm batch script
    where it runs under srun and names no node (the allocation's nodes are the job's), or
    the local trainer."""
    if job.parallel.gpus_per_node == 0:
        return TRAIN
    cluster = job.cluster
    if cluster.executor == "srun" and cluster.head is None and not cluster.workers:
        return SBATCH
    return LAUNCH


def preflight(job: JobConfig) -> tuple[str, list[str]]:
    """(the command the config is for, every problem that command refuses it for)."""
    command = command_for(job)
    if command == TRAIN:
        return command, train_problems(job)
    return command, launch_problems(job, place_hosts=command == LAUNCH)


def launch_problems(job: JobConfig, place_hosts: bool = True) -> list[str]:
    """Everything `opd launch` checks before it reaches a node, each problem with its fix:
    the cluster settings and slime flags, the hosts (not for --sbatch, whose nodes are
    the allocation's), and the tokenizers when both checkpoints are readable here."""
    checks: list[Callable[[JobConfig], object]] = [
        check_cluster,
        check_local_tokenizers,
        check_tasks_file,
    ]
    if place_hosts:
        checks.insert(1, hosts_from_config)
    problems = []
    for check in checks:
        try:
            check(job)
        except ConfigError as err:
            problems.append(str(err))
    return problems


def train_problems(job: JobConfig) -> list[str]:
    """Everything `opd train` refuses before it builds anything."""
    from slime_ext.local.preflight import UnsupportedLocalJob, check_local_job

    try:
        check_local_job(job)
    except UnsupportedLocalJob as err:
        return [str(err)]
    return []


def local_tokenizer_identity(path: str) -> str | None:
    """The identity of a tokenizer directory readable here; None when it is not local."""
    if (
        not Path(path, "tokenizer_config.json").is_file()
        and not Path(path, "tokenizer.json").is_file()
    ):
        return None
    from transformers import AutoTokenizer

    return tokenizer_identity(AutoTokenizer.from_pretrained(path))


def check_tokenizers(student: str | None, teacher: str | None) -> None:
    """The teacher must tokenize exactly as the student (content, not config.vocab_size:
    Megatron and HF checkpoints pad the vocabulary differently)."""
    if not student or not teacher:
        return
    if vocab_digest(student) != vocab_digest(teacher):
        raise ConfigError(
            f"the teacher's tokenizer ({teacher}) differs from the student's ({student}): "
            "the teacher would score other tokens than the student sampled. Serve a teacher "
            "that shares the student's tokenizer (same vocabulary and merges)"
        )


def check_local_tokenizers(job: JobConfig) -> None:
    """Compare when both checkpoints are readable from here (no-op otherwise)."""
    student = local_tokenizer_identity(job.model.tokenizer or job.model.student)
    teacher = local_tokenizer_identity(job.teacher.model) if job.teacher.model else None
    check_tokenizers(student, teacher)


def check_tasks_file(job: JobConfig) -> int | None:
    """The rows of cluster.tasks_file when it is readable here (its first rows parsed as
    the recipe reads them); None where it is not (a path on the cluster's storage)."""
    from launch.tasks_file import TasksFileError, check

    name = job.cluster.tasks_file
    if not name or not Path(name).is_file():
        return None
    try:
        return check(Path(name), job.rollout.harness, job.algorithm.recipe)
    except TasksFileError as err:
        raise ConfigError(f"cluster.tasks_file: {err}") from None
    except OSError as err:
        raise ConfigError(f"cluster.tasks_file {name}: {err.strerror}") from None
