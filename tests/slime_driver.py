"""Test-only: drive THUDM/slime's own functions with our hooks (slime installed by
`make slime`; its CPU import stand-ins in tests/slime_cpu.py).

- `require_slime()`: the real-slime tests skip without slime, saying how to install it,
  and fail under CI (which must run them).
- `slime_args(job, ...)`: the arguments `opd launch` writes for a job, parsed by slime's
  own parser (its real defaults), plus what slime's parse_args would add.
- `rollout_manager(args, groups, dp_size)`: slime's RolloutManager (its real methods)
  over the groups a rollout function returned, without Ray actors or SGLang engines.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from launch.plan import train_args
from slime_ext.job.config import JobConfig
from tests import slime_cpu


def require_slime() -> None:
    """At a module's top: stand-ins installed; skip (fail under CI) without slime."""
    slime_cpu.install()
    if slime_cpu.slime_installed():
        return
    if os.environ.get("CI"):
        pytest.fail(slime_cpu.HOW_TO_INSTALL, pytrace=False)
    pytest.skip(slime_cpu.HOW_TO_INSTALL, allow_module_level=True)


def sample_class() -> Any:
    """slime's Sample, for a test that needs nothing else of slime (skips as above)."""
    require_slime()
    from slime.utils.types import Sample

    return Sample


def slime_args(
    job: JobConfig, directory: Path, *, tp: int = 1, cp: int = 1, vocab: int | None = None
) -> argparse.Namespace:
    """`opd launch`'s train.py arguments for `job` through slime's own parser, with the
    custom-config YAML's key (opd_job_config, as slime_validate_args sets it) and the
    Megatron-LM arguments slime's parser does not own (the layout, the vocabulary)."""
    from slime.utils.arguments import _pre_parse_mode, get_slime_extra_args_provider

    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(job.model_dump(mode="json")))
    parser = argparse.ArgumentParser(allow_abbrev=False)
    get_slime_extra_args_provider()(parser)
    try:  # the router's flags, where sglang_router is installed
        from slime.backends.sglang_utils.arguments import add_sglang_router_arguments

        add_sglang_router_arguments(parser)
    except slime_cpu.StandInCalled:
        pass
    plan_args = train_args(job, str(directory / "hooks.yaml"))
    args, megatron_only = parser.parse_known_args(plan_args)
    assert "--tensor-model-parallel-size" in megatron_only  # the plan wrote Megatron's too
    saved_argv = sys.argv
    sys.argv = ["train.py", *plan_args]  # slime's parse_args pre-parses the mode flags
    try:
        for key, value in vars(_pre_parse_mode()).items():
            setattr(args, key, value)
    finally:
        sys.argv = saved_argv
    # slime's SGLang arguments, which its own parser takes from sglang's ServerArgs (here
    # cpu_runtime.sglang_api's): the ones the rollout side reads, at slime's defaults
    args.sglang_server_concurrency, args.sglang_dp_size = 512, None
    args.opd_job_config = str(path)
    args.tensor_model_parallel_size, args.context_parallel_size = tp, cp
    args.padded_vocab_size = vocab
    args.sequence_parallel = "--sequence-parallel" in megatron_only
    return args


def rollout_manager(args: Any, groups: list[Any], dp_size: int = 1) -> Any:
    """slime's RolloutManager class (not its Ray actor) with the state its data methods
    read; its rollout function returns `groups`."""
    from slime.ray.rollout import RolloutManager
    from slime.rollout.base_types import RolloutFnTrainOutput
    from slime.utils.misc import load_function

    manager = object.__new__(RolloutManager.__ray_metadata__.modified_class)
    manager.args = args
    manager.generate_rollout = lambda *a, **k: RolloutFnTrainOutput(samples=groups, metrics=None)
    manager.data_source = None
    post_process = args.custom_reward_post_process_path
    manager.custom_reward_post_process_func = load_function(post_process) if post_process else None
    manager.custom_convert_samples_to_train_data_func = None
    # what the actor reports (actor.py, init): no pipeline or virtual stages here
    manager.train_parallel_config = {
        "dp_size": dp_size,
        "cp_size": args.context_parallel_size,
        "vpp_size": 1,
        "microbatch_group_size_per_vp_stage": 1,
    }
    return manager


RANK_PRELOAD = ["tests.rank_preload"]
"""What the forkserver the ranks fork from imports once (tests/rank_preload.py)."""


def spawn_ranks(rank: Callable[..., None], world: int, *args: Any) -> None:
    """Start `world` gloo ranks, `rank(index, world, init_method, *args)`, and wait for
    them all (one failing fails the call, with its traceback). They fork from a forkserver
    that imported what every rank imports (RANK_PRELOAD), in this process's environment
    as it is now (a forked rank would have the forkserver's); they meet at a file in a new
    directory, not at a port (nothing to probe, nothing another process can take)."""
    import multiprocessing
    import shutil
    import tempfile

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(RANK_PRELOAD)  # before the forkserver starts
    meeting = Path(tempfile.mkdtemp(prefix="opd-ranks-"))
    try:
        mp.start_processes(
            _in_environment, args=(dict(os.environ), rank, world, f"file://{meeting}/store", *args),
            nprocs=world, join=True, start_method="forkserver",
        )  # fmt: skip
    finally:
        shutil.rmtree(meeting, ignore_errors=True)


def _in_environment(
    index: int, environ: dict[str, str], rank: Callable[..., None], *args: Any
) -> None:
    os.environ.clear()
    os.environ.update(environ)
    rank(index, *args)


def run_ranks(rank: Callable[..., None], world: int, layout: Any, directory: Path) -> list[Any]:
    """`world` gloo ranks (spawn_ranks): `rank(index, world, init_method, layout,
    directory)` saves its results to directory/rank<index>.pt; they are returned in rank
    order."""
    import torch

    spawn_ranks(rank, world, layout, str(directory))
    return [torch.load(directory / f"rank{r}.pt", weights_only=False) for r in range(world)]


def split_by_dp(manager: Any, data: dict[str, Any]) -> list[Any]:
    """_split_train_data_by_dp with Ray's object store bypassed: each Box holds its payload."""
    import ray

    saved_put = ray.put
    ray.put = lambda value, **kwargs: value
    try:
        return list(manager._split_train_data_by_dp(data))
    finally:
        ray.put = saved_put
