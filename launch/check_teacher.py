"""Compare a running teacher service's tokenizer with the student's: a step of the batch
script `opd launch --sbatch` writes (`opd launch` makes the same check itself).

    python3 -m launch.check_teacher --info-url http://NODE:8000/v1/info \
        --student /models/student [--api-key-env OPD_TEACHER_KEY]

Exits 0 when they tokenize alike, or when the student's tokenizer is not readable on this
node (said so); exits 1 naming the difference, or when the service gives no identity.
"""

from __future__ import annotations

import argparse
import os
import sys

import httpx

from launch.checks import check_tokenizers, local_tokenizer_identity
from slime_ext.job.config import ConfigError


def check(info_url: str, student: str, api_key: str | None) -> str:
    """What the check found; raises ConfigError when the tokenizers differ and
    RuntimeError when the service gives no identity."""
    identity = local_tokenizer_identity(student)
    if identity is None:
        return f"the student's tokenizer ({student}) is not readable here: not compared"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        teacher = httpx.get(info_url, headers=headers, timeout=30.0).json()["tokenizer"]
    except (httpx.HTTPError, KeyError, ValueError, TypeError) as err:
        raise RuntimeError(f"no tokenizer identity from {info_url}: {err}") from None
    check_tokenizers(identity, teacher)
    return f"the teacher at {info_url} tokenizes as the student ({student})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--info-url", required=True, help="The service's /v1/info.")
    parser.add_argument("--student", required=True, help="The student's tokenizer directory.")
    parser.add_argument("--api-key-env", help="The variable holding the service's API key.")
    args = parser.parse_args(argv)
    key = os.environ.get(args.api_key_env) if args.api_key_env else None
    try:
        print(check(args.info_url, args.student, key), flush=True)
    except (ConfigError, RuntimeError) as err:
        print(f"teacher tokenizer check failed: {err}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
