"""Checks a launch makes against the real artifacts, beyond what the config alone says."""

from __future__ import annotations

from pathlib import Path

from launch.config import ConfigError, JobConfig
from teacher_server.backend import tokenizer_identity, vocab_digest


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
