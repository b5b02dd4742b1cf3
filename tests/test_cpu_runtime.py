"""slime_ext.cpu_runtime as a process started with its environment sees it (Ray's workers,
torchrun's ranks): nothing loaded at start, and each site redirected when it loads. The
whole job it serves runs in tests/test_slime_train.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from slime_ext.cpu_runtime import runtime_env_vars
from tests.slime_driver import require_slime

require_slime()

PROBE = """
import json, sys
started = {"torch": "torch" in sys.modules, "slime": "slime" in sys.modules}
from slime.utils import accelerator
import megatron.training.training as training
import megatron.core.utils as core_utils
import slime.backends.megatron_utils.initialize as initialize
import megatron.core.ssm.gated_delta_net as gated_delta_net
import megatron.core.fusions.fused_bias_geglu as geglu
import megatron.core.jit as jit
import slime.backends.megatron_utils.actor
import slime.utils.ppo_utils as ppo_utils
fla_with_megatron = "fla" in sys.modules
dynamo_with_megatron = "torch._dynamo" in sys.modules
import fla.modules.l2norm  # slime's hybrid layers import it themselves: still there
import torch
compiled = [
    hasattr(f, "_torchdynamo_orig_callable")
    for f in (geglu.bias_geglu, ppo_utils.compute_approx_kl, ppo_utils.compute_policy_loss)
]
kl = ppo_utils.compute_approx_kl(torch.tensor([0.5]), torch.tensor([0.25]), "k1")
linear = torch.nn.Linear(2, 2)
print(json.dumps({
    "fla_with_megatron": fla_with_megatron,
    "megatron_has_fla": gated_delta_net.HAVE_FLA,
    "fla_later": fla.modules.l2norm.l2norm.__module__,
    "dynamo_with_megatron": dynamo_with_megatron,
    "jit_fuser_eager": jit.jit_fuser is jit.noop_decorator,
    "compiled": compiled,
    "kl": kl.tolist(),
    "torch_compile_kept": torch.compile.__module__,
    "started": started,
    "accelerator": accelerator.get_accelerator().name,
    "backend": accelerator.process_group_backend("nccl"),
    "weights_backend": accelerator.weight_update_backend(),
    "training_torch": training.torch.__name__,
    "core_torch": core_utils.torch.__name__,
    "numpy_seen_by_slime": initialize.np.__version__,
    "cuda_to_cpu_kept": linear.cuda(torch.device("cpu")) is linear,
    "buffer_device": str(core_utils.torch.zeros(2, device="cuda").device),
    "pinned_copy": str(training.torch.empty(2, pin_memory=True).device),
}))
"""


@pytest.mark.timeout(120)
def test_a_process_started_with_the_runtime_env_runs_slime_and_megatron_on_the_cpu() -> None:
    import slime

    slime_checkout = os.path.dirname(os.path.dirname(slime.__file__))
    env = os.environ | runtime_env_vars(slime_checkout)
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=110,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["started"] == {"torch": False, "slime": False}  # sitecustomize is lazy
    assert seen["accelerator"] == "cpu"
    assert seen["backend"] == seen["weights_backend"] == "gloo"
    assert seen["training_torch"] == seen["core_torch"] == "torch (CPU redirect)"
    assert seen["numpy_seen_by_slime"] == "1.26.4"
    assert seen["cuda_to_cpu_kept"] and seen["buffer_device"] == "cpu"
    assert seen["pinned_copy"] == "cpu"
    # megatron-core's Gated DeltaNet loaded without flash-linear-attention (cpu_runtime.HIDDEN),
    # which a later import still finds
    assert not seen["fla_with_megatron"] and not seen["megatron_has_fla"]
    assert seen["fla_later"].startswith("fla.")
    # megatron-core's fused functions and slime's PPO losses eager (cpu_runtime.EAGER): no
    # TorchDynamo, each function as written (and computing), torch.compile itself kept
    assert not seen["dynamo_with_megatron"] and seen["jit_fuser_eager"]
    assert seen["compiled"] == [False, False, False] and seen["kl"] == [0.25]
    assert seen["torch_compile_kept"] == "torch"


def _printed(probe: str, env: dict[str, str]) -> str:
    """The last line `probe` prints in a fresh interpreter with `env`."""
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=110,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.timeout(120)
def test_a_process_that_loaded_fla_first_keeps_it_for_megatron() -> None:
    probe = "import fla.modules.l2norm, megatron.core.ssm.gated_delta_net as g; print(g.HAVE_FLA)"
    assert _printed(probe, os.environ | runtime_env_vars()) == "True"


@pytest.mark.timeout(120)
def test_without_the_flag_the_same_process_is_left_alone() -> None:
    env = os.environ | runtime_env_vars() | {"OPD_CPU_RUNTIME": "0"}
    probe = "import sys, megatron.core.utils as u; print(u.torch.__name__)"
    assert _printed(probe, env) == "torch"
