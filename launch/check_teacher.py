"""Compare a running teacher service's tokenizer with the student's: a step of the batch
script `opd launch --sbatch` writes (`opd launch` makes the same check itself).

    python3 -m launch.check_teacher --info-url http://NODE:8000/v1/info \
        --student /models/student [--api-key-env OPD_TEACHER_KEY] [--context-budget N]

Exits 0 when they tokenize alike, or when the student's tokenizer is not readable on this
node (said so); exits 1 naming the difference, when the service accepts no input as long
as the job's longest turn (--context-budget), or when it gives no identity.
"""

from __future__ import annotations

import argparse
import os
import sys

import httpx

from launch.checks import check_tokenizers, local_tokenizer_identity
from slime_ext.job.config import ConfigError


def check(info_url: str, student: str, api_key: str | None, budget: int | None = None) -> str:
    """What the check found; raises ConfigError when the tokenizers differ or the service
    refuses contexts as long as the job's `budget`, RuntimeError when it gives no info."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        info = httpx.get(info_url, headers=headers, timeout=30.0).json()
        teacher, max_context = info["tokenizer"], int(info["max_context"])
    except (httpx.HTTPError, KeyError, ValueError, TypeError) as err:
        raise RuntimeError(f"no tokenizer identity from {info_url}: {err}") from None
    check_context(info_url, max_context, budget)
    identity = local_tokenizer_identity(student)
    if identity is None:
        return f"the student's tokenizer ({student}) is not readable here: not compared"
    check_tokenizers(identity, teacher)
    return f"the teacher at {info_url} tokenizes as the student ({student})"


def check_context(info_url: str, max_context: int, budget: int | None) -> None:
    """The service's longest input against the job's longest turn (context + generation)."""
    if budget is not None and max_context < budget:
        raise ConfigError(
            f"the teacher at {info_url} accepts inputs of at most {max_context} ids, and a "
            f"turn of this job reaches {budget} (rollout.max_context_tokens + "
            "max_new_tokens): its longest turns would be refused (413). Lower "
            f"rollout.max_context_tokens to at most {max_context} - max_new_tokens, or serve "
            "the teacher with a longer context"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--info-url", required=True, help="The service's /v1/info.")
    parser.add_argument("--student", required=True, help="The student's tokenizer directory.")
    parser.add_argument("--api-key-env", help="The variable holding the service's API key.")
    parser.add_argument("--context-budget", type=int, help="The job's longest turn (ids).")
    args = parser.parse_args(argv)
    key = os.environ.get(args.api_key_env) if args.api_key_env else None
    try:
        print(check(args.info_url, args.student, key, args.context_budget), flush=True)
    except (ConfigError, RuntimeError) as err:
        print(f"teacher tokenizer check failed: {err}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
