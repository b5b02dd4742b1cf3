"""`eval_script` for SWE-bench rows that lack one (datasets from before swebench 5).

swebench 5 grades with the eval script each dataset row carries (SWE-bench/SWE-bench,
_Lite, _Verified on the Hub have it). swebench 2 to 4 built that script themselves from
their per-repository, per-version specs (`make_eval_script_list(row, specs, ...)` in
`swebench.harness.test_spec.create_scripts` (3, 4) or `swebench.harness.test_spec` (2),
the specs in `swebench.harness.constants.MAP_REPO_VERSION_TO_SPECS`); swebench 5 has none
of it left.

`add_eval_scripts(rows)` fills the missing ones with that code when the installed
swebench has it (only the eval script: nothing is fetched, no image is built); otherwise
it raises `EvalScriptsUnavailableError`, which says what to do. opd itself grades with
swebench 5, so the scripts are made in an environment of their own, from the repository
root (this module needs swebench alone, and pyarrow for parquet):

    python -m venv /tmp/swebench4 && /tmp/swebench4/bin/pip install 'swebench>=2,<5'
    /tmp/swebench4/bin/python -m rollout.tasks.swe_eval_scripts lite.parquet \
        --out lite_with_scripts.jsonl
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

SCRIPT_MODULES = ("swebench.harness.test_spec.create_scripts", "swebench.harness.test_spec")
"""Where swebench 3-4 and swebench 2 keep `make_eval_script_list`."""
REPO_DIR, ENV_NAME = "/testbed", "testbed"
"""Where SWE-bench images hold the repository, and their conda environment."""
SCRIPT_HEADER = ["#!/bin/bash", "set -uxo pipefail"]
"""What swebench's TestSpec.eval_script puts before the commands."""
MAKE_THEM = (
    "make them with swebench's own test-spec code, in an environment of its own from this "
    "repository's root: `python -m venv /tmp/swebench4 && /tmp/swebench4/bin/pip install "
    "'swebench>=2,<5'`, then `/tmp/swebench4/bin/python -m rollout.tasks.swe_eval_scripts "
    "DATASET --out FILE` (docs/evaluation.md); or take the rows from a swebench 5 dataset, "
    "which carries them"
)


class EvalScriptsUnavailableError(RuntimeError):
    """The installed swebench cannot build eval scripts (swebench 5 removed that code)."""


class EvalScriptError(ValueError):
    """swebench's test-spec code could not build a row's script (a missing field, an
    unknown repository or version); names the rows."""


ScriptMaker = Callable[[dict[str, Any]], str]


def legacy_eval_script_maker() -> ScriptMaker:
    """row -> its eval script, by swebench's own test-spec code (swebench 2-4)."""
    make_list: Any = None
    for name in SCRIPT_MODULES:
        try:
            make_list = getattr(importlib.import_module(name), "make_eval_script_list", None)
        except ImportError:
            continue
        if callable(make_list):
            break
    if not callable(make_list):
        import swebench

        version = getattr(swebench, "__version__", "?")
        raise EvalScriptsUnavailableError(
            f"the installed swebench ({version}) has no test-spec code to build eval scripts "
            f"(it was removed in swebench 5): {MAKE_THEM}"
        )
    from swebench.harness.constants import MAP_REPO_VERSION_TO_SPECS

    def make(row: dict[str, Any]) -> str:
        specs = MAP_REPO_VERSION_TO_SPECS[row["repo"]][row["version"]]
        commands = make_list(row, specs, ENV_NAME, REPO_DIR, row["base_commit"], row["test_patch"])
        return "\n".join([*SCRIPT_HEADER, *commands]) + "\n"

    return make


def add_eval_scripts(rows: Iterable[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The rows, each without an `eval_script` given swebench's; and how many were made.
    Raises EvalScriptsUnavailableError before any row when swebench cannot make them."""
    rows = [dict(row) for row in rows]
    missing = [row for row in rows if not (row.get("eval_script") or "").strip()]
    if not missing:
        return rows, 0
    make = legacy_eval_script_maker()
    failed: list[str] = []
    for row in missing:
        try:
            row["eval_script"] = make(row)
        except (KeyError, ValueError, TypeError) as err:
            failed.append(
                f"{row.get('instance_id')} (repo {row.get('repo')!r}, version "
                f"{row.get('version')!r}): {type(err).__name__}: {err}"
            )
    if failed:
        shown = "\n  ".join(failed[:5])
        more = f"\n  and {len(failed) - 5} more" if len(failed) > 5 else ""
        raise EvalScriptError(
            f"swebench's test-spec code could not build the eval script of {len(failed)} rows "
            "(it needs SWE-bench's fields, test_patch among them, and knows SWE-bench's "
            f"repositories and versions only):\n  {shown}{more}"
        )
    return rows, len(missing)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a .jsonl or .parquet file (this module runs without opd's dependencies)."""
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        return [dict(row) for row in pq.read_table(path).to_pylist()]
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rollout.tasks.swe_eval_scripts",
        description="Give SWE-bench rows without an eval_script the one swebench's own "
        "test-spec code builds (swebench 2-4). Rows that have one keep it.",
    )
    parser.add_argument("dataset", type=Path, help="SWE-bench rows (.jsonl or .parquet)")
    parser.add_argument("--out", type=Path, required=True, help="the rows, as JSONL")
    args = parser.parse_args(argv)
    try:
        rows, made = add_eval_scripts(read_rows(args.dataset))
    except (EvalScriptsUnavailableError, EvalScriptError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(row, default=str) + "\n" for row in rows)
    args.out.write_text(text, encoding="utf-8")
    print(f"{made} eval scripts made, {len(rows) - made} kept; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
