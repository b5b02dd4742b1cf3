"""How long a Megatron process of a whole CPU job takes to import what it runs under the
CPU runtime, with and without its two import savings, side by side in one run.

Every MegatronTrainRayActor of slime's train.py (and every converter under torchrun)
imports `slime.backends.megatron_utils.actor`'s world before it does anything. Under the
CPU runtime (slime_ext/cpu_runtime, OPD_CPU_RUNTIME=1):
- megatron-core's Gated DeltaNet is loaded with flash-linear-attention hidden
  (`cpu_runtime.HIDDEN`);
- megatron-core's fused functions and slime's PPO losses are left eager, not compiled at
  import (`cpu_runtime.EAGER`): the import loads neither TorchDynamo nor Inductor.
Modes: "before", the runtime with neither (its finder's hidden packages and eager modules
emptied, the jit_fuser hook removed, before the import); "fla hidden", the first alone
(the last stop's runtime); "now", both. Each pass is a fresh interpreter; the modes
alternate, and the table gives each one's median and its ratio to "before".

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

NO_EAGER = """
import sys
from slime_ext import cpu_runtime
[finder] = [f for f in sys.meta_path if isinstance(f, cpu_runtime._AfterImport)]
finder.eager = ()
finder.hooks.pop("megatron.core.jit")
"""
MODES = {"before": NO_EAGER + "finder.hidden = {}\n", "fla hidden": NO_EAGER, "now": ""}
"""What each mode runs before the import: the runtime's finder without its savings."""
EXPECTED = {"before": (True, True), "fla hidden": (False, True), "now": (False, False)}
"""(fla loaded, TorchDynamo loaded) after the import, per mode."""


def one_start(module: str, mode: str, env: dict[str, str], cwd: Path) -> float:
    """Seconds a fresh interpreter under the CPU runtime takes to set up `mode` and import
    `module` (measured inside it: the interpreter's own start is the same in each)."""
    code = (
        "import time, sys\nt = time.perf_counter()\n"
        f"{MODES[mode]}\nimport {module}\n"
        "print(time.perf_counter() - t, 'fla' in sys.modules, 'torch._dynamo' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True,
        timeout=600, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"the import failed:\n{done.stderr[-3000:]}")
    seconds, fla, dynamo = done.stdout.split()[-3:]
    if (fla == "True", dynamo == "True") != EXPECTED[mode]:
        raise SystemExit(
            f"{mode}: fla loaded {fla}, TorchDynamo {dynamo}, expected {EXPECTED[mode]}"
            " (is the runtime on?)"
        )
    return float(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--module", default="slime.backends.megatron_utils.actor")
    args = parser.parse_args()
    import slime

    checkout = Path(slime.__file__).resolve().parents[1]
    env = os.environ | runtime_env_vars(str(checkout)) | {"OMP_NUM_THREADS": "1"}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for index in range(args.passes):
        for mode in MODES:
            seconds = one_start(args.module, mode, env, checkout)
            times[mode].append(seconds)
            print(f"pass {index + 1}/{args.passes} {mode}: {seconds:.2f} s", flush=True)
    medians = {mode: statistics.median(seconds) for mode, seconds in times.items()}
    print(f"\nimport {args.module} under the CPU runtime, median of {args.passes}:")
    print("| mode | seconds | / before |\n|---|---|---|")
    for mode, seconds in medians.items():
        print(f"| {mode} | {seconds:.2f} | {seconds / medians['before']:.2f}x |")


if __name__ == "__main__":
    main()
