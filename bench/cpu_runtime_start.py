"""How long a Megatron process of a whole CPU job takes to import what it runs, with and
without flash-linear-attention loaded through megatron-core's Gated DeltaNet, side by
side in one run.

Every MegatronTrainRayActor of slime's train.py (and every converter under torchrun)
imports `slime.backends.megatron_utils.actor`'s world before it does anything. Under the
CPU runtime (slime_ext/cpu_runtime, OPD_CPU_RUNTIME=1) megatron-core's Gated DeltaNet is
loaded with fla hidden (`cpu_runtime.HIDDEN`): "now". "before": the same process with
fla's two modules that Gated DeltaNet imports loaded first, which is what it did before
(the hiding leaves a process that already has fla alone). Each pass is a fresh
interpreter; the modes alternate, and the table gives each one's median and now / before.

    .venv/bin/python bench/cpu_runtime_start.py [--passes 5] [--module MODULE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from slime_ext.cpu_runtime import runtime_env_vars

BEFORE = "import fla.modules.l2norm, fla.ops.gated_delta_rule"
"""What megatron-core's Gated DeltaNet imported before the CPU runtime hid fla from it."""


def one_start(module: str, first: str, env: dict[str, str], cwd: Path) -> float:
    """Seconds a fresh interpreter under the CPU runtime takes to run `first` and import
    `module` (measured inside it: the interpreter's own start is the same in both)."""
    code = (
        "import time, sys\nt = time.perf_counter()\n"
        f"{first}\nimport {module}\n"
        "print(time.perf_counter() - t, 'fla' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True,
        timeout=600, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"the import failed:\n{done.stderr[-3000:]}")
    seconds, fla = done.stdout.split()[-2:]
    if (fla == "True") != bool(first):
        raise SystemExit(f"fla loaded: {fla}, expected {bool(first)} (is the runtime on?)")
    return float(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--module", default="slime.backends.megatron_utils.actor")
    args = parser.parse_args()
    import slime

    checkout = Path(slime.__file__).resolve().parents[1]
    env = os.environ | runtime_env_vars(str(checkout)) | {"OMP_NUM_THREADS": "1"}
    times: dict[str, list[float]] = {"before": [], "now": []}
    for index in range(args.passes):
        for name, first in (("before", BEFORE), ("now", "")):
            seconds = one_start(args.module, first, env, checkout)
            times[name].append(seconds)
            print(f"pass {index + 1}/{args.passes} {name}: {seconds:.2f} s", flush=True)
    before, now = (statistics.median(times[name]) for name in ("before", "now"))
    print(f"\nimport {args.module} under the CPU runtime, median of {args.passes}:")
    print("| mode | seconds |\n|---|---|")
    print(f"| before (fla through Gated DeltaNet) | {before:.2f} |")
    print(f"| now (fla hidden there) | {now:.2f} |")
    print(f"now / before: {now / before:.2f}x")


if __name__ == "__main__":
    main()
