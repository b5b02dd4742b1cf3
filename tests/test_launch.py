"""`opd launch`: the rendered plan (golden files), the checks a cluster job must pass,
and a launch against a local fake cluster (an ssh shim that runs every host's commands on
this machine, fake `ray` / `torchrun`, and the real `opd-teacher`)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

from launch.checks import check_tokenizers, local_tokenizer_identity
from launch.cli import app
from launch.executor import Executor, LaunchError
from launch.plan import (
    Hosts,
    Step,
    build_plan,
    check_cluster,
    hosts_from_config,
    render_dry_run,
    render_sbatch,
    secret_names,
)
from launch.rehearsal_run import Outcome
from slime_ext.job.config import ConfigError, config_from_dict, load_config, read_config_data
from slime_ext.job.slime_flags import given_flags
from teacher_server.cli import app as teacher_cli
from tests import megatron_converter_standin as converter_standin
from tests.launch_standins import standin_tasks
from tests.live_server import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "launch/configs/swe-opd-cluster.yaml"
OPSD_EXAMPLE = ROOT / "launch/configs/swe-opsd-35b-a3b.yaml"
OPRD_EXAMPLE = ROOT / "launch/configs/swe-oprd-35b-a3b.yaml"
GOLDEN = ROOT / "tests/data/launch"
EXAMPLES: dict[str, tuple[str, list[str]]] = {
    "swe-opd-cluster": ("swe-opd-cluster", []),
    "swe-opsd-35b-a3b": ("swe-opsd-35b-a3b", []),
    "swe-opsd-35b-a3b-ema": ("swe-opsd-35b-a3b", ["--set", "teacher.snapshot=ema"]),
    "swe-oprd-35b-a3b": ("swe-oprd-35b-a3b", []),
}
"""Plans that are golden files, tests/data/launch/<name>.dry-run.txt/.sbatch: an example
config and overrides."""


def _regenerate(name: str) -> str:
    config, overrides = EXAMPLES[name]
    command = f".venv/bin/opd launch launch/configs/{config}.yaml {' '.join(overrides)}"
    return (
        f"{command} --dry-run > tests/data/launch/{name}.dry-run.txt; and with --sbatch "
        f"/tmp/x.sbatch copied to tests/data/launch/{name}.sbatch"
    )


@pytest.mark.parametrize("name", EXAMPLES)
def test_dry_run_of_the_example_config_is_the_golden_plan(name: str) -> None:
    config, overrides = EXAMPLES[name]
    path = ROOT / f"launch/configs/{config}.yaml"
    result = CliRunner().invoke(app, ["launch", str(path), *overrides, "--dry-run"])
    assert result.exit_code == 0, result.output
    golden = (GOLDEN / f"{name}.dry-run.txt").read_text()
    assert result.output == golden, (
        f"the plan changed; if intended, regenerate: {_regenerate(name)}"
    )


@pytest.mark.parametrize("name", EXAMPLES)
def test_sbatch_of_the_example_config_is_the_golden_script(name: str, tmp_path: Path) -> None:
    config, overrides = EXAMPLES[name]
    path = ROOT / f"launch/configs/{config}.yaml"
    out = GOLDEN / f"{name}.sbatch"
    script = tmp_path / "job.sbatch"
    result = CliRunner().invoke(app, ["launch", str(path), *overrides, "--sbatch", str(script)])
    assert result.exit_code == 0, result.output
    # the golden file was written to /tmp/x.sbatch; only that comment line differs
    rendered = script.read_text().replace(str(script), "/tmp/x.sbatch")
    assert rendered == out.read_text(), f"the script changed; regenerate: {_regenerate(name)}"
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0


def test_reference_plan_has_the_reference_layout() -> None:
    job = load_config(EXAMPLE)
    steps = build_plan(job, hosts_from_config(job))
    names = [s.name for s in steps]
    # the teacher loads while the checkpoint converts and Ray's cluster forms
    order = ["teacher sglang", "convert checkpoint", "ray head", "wait ray cluster"]
    order += ["wait teacher sglang", "teacher service", "wait teacher", "submit"]
    assert sorted(order, key=names.index) == order
    submit = steps[-1].command
    for flag in (
        "--tensor-model-parallel-size 2",
        "--context-parallel-size 2",
        "--actor-num-nodes 4",
        "--actor-num-gpus-per-node 4",
        "--max-tokens-per-gpu 38912",
        "--rollout-max-response-len 12288",
        "--custom-generate-function-path slime_ext.slime.generate.generate",
        "--custom-loss-function-path slime_ext.slime.loss.loss",
        "--custom-reward-post-process-path slime_ext.slime.reward.post_process_rewards",
    ):
        assert flag in submit
    [write_job] = [s for s in steps if s.name == "write job config"]
    assert yaml.safe_load(write_job.content)["teacher"]["url"] == "http://teacher-node:8000"


def test_opsd_plan_serves_the_students_snapshot_as_the_teacher() -> None:
    """OPSD on a cluster: the teacher node runs opd-teacher (SGLang) from the student's own
    HF checkpoint with the API key, loading while Ray starts; the hooks get its URL; the MoE
    student's expert layout reaches Megatron."""
    job = load_config(OPSD_EXAMPLE)
    assert job.teacher.kind == "self" and job.teacher.model == job.model.student
    steps = build_plan(job, hosts_from_config(job))
    names = [s.name for s in steps]
    assert names.index("teacher sglang") < names.index("ray head") < names.index("teacher service")
    assert names.index("teacher service") < names.index("wait teacher") < names.index("submit")
    by_name = {s.name: s for s in steps}
    sglang = by_name["teacher sglang"]
    assert sglang.host == "teacher-node" and sglang.kind == "background"
    assert "--model-path /models/Qwen3.5-35B-A3B --tp-size 4" in sglang.command
    service = by_name["teacher service"].command
    assert service.startswith("env OPD_TEACHER_API_KEY=${OPD_TEACHER_API_KEY} opd-teacher serve")
    assert "--backend sglang --model /models/Qwen3.5-35B-A3B" in service
    written = yaml.safe_load(by_name["write job config"].content)
    assert written["teacher"]["url"] == "http://teacher-node:8000"
    assert written["algorithm"]["recipe"] == "opsd" and written["teacher"]["hint"] == "critic"
    submit = steps[-1].command
    for flag in (
        "--expert-model-parallel-size 8",
        "--expert-tensor-parallel-size 1",
        "--tensor-model-parallel-size 2",
        "--context-parallel-size 2",
        "--actor-num-nodes 4",
        "--max-tokens-per-gpu 38912",
        "--rollout-max-response-len 12288",
        "--custom-generate-function-path slime_ext.slime.generate.generate",
    ):
        assert flag in submit
    assert job.parallel.data_parallel == 4 and job.parallel.num_experts == 256


def test_opsd_self_teacher_with_an_hf_backend_and_a_named_copy_of_the_snapshot() -> None:
    job = _opsd_job(teacher={"backend": "hf", "model": "/local/Qwen3.5-35B-A3B"})
    steps = build_plan(job, hosts_from_config(job))
    service = next(s for s in steps if s.name == "teacher service").command
    assert "--backend hf --model /local/Qwen3.5-35B-A3B" in service
    assert "--device cuda --dtype bfloat16" in service
    assert not any(s.name == "teacher sglang" for s in steps)


def test_opsd_self_teacher_already_running_is_only_waited_for() -> None:
    job = _opsd_job(teacher={"node": None, "url": "http://snapshot:9000"})
    steps = build_plan(job, hosts_from_config(job))
    teacher = [s for s in steps if "teacher" in s.name]
    assert [s.name for s in teacher] == ["wait teacher", "check teacher tokenizer"]
    assert teacher[0].command == "http://snapshot:9000/health"


def _opsd_job(**sections: Any) -> Any:
    base: dict[str, Any] = read_config_data(OPSD_EXAMPLE)
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    return config_from_dict(base)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        (
            {"teacher": {"snapshot": "refresh", "api_key_env": None}},
            "teacher.api_key_env: teacher.snapshot 'refresh' reloads the teacher through its "
            "authenticated /v1/reload",
        ),
        (
            {"teacher": {"snapshot": "ema", "node": None, "url": "http://snapshot:9000"}},
            "teacher.node: teacher.snapshot 'ema' runs `opd-teacher sync` next to the service",
        ),
        (
            {"teacher": {"snapshot": "ema", "ema_sync_every": 200}},
            "teacher.ema_sync_every: no snapshot step before the last of algorithm.steps 200",
        ),
        (
            {"teacher": {"snapshot": "refresh", "snapshot_converter": "convert {input_dir}"}},
            r"teacher.snapshot_converter: .* needs \{input_dir\} and \{output_dir\}",
        ),
        ({"teacher": {"node": None}}, "set teacher.node .* or teacher.url"),
    ],
)
def test_opsd_cluster_checks_say_what_to_fix(sections: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_cluster(_opsd_job(**sections))


def test_the_served_checkpoint_is_the_students_for_a_self_teacher_and_must_be_named_else() -> None:
    job = _opsd_job(teacher={"model": None})  # kind self: the student's own snapshot
    assert job.teacher.model == job.model.student
    opd = read_config_data(EXAMPLE)
    opd["teacher"]["model"] = None
    with pytest.raises(ConfigError, match=r"teacher\.model: the checkpoint `opd launch` serves"):
        check_cluster(config_from_dict(opd))


def test_opsd_refresh_plan_syncs_the_teacher_from_slimes_checkpoints() -> None:
    """snapshot refresh: after the service is up, `opd-teacher sync` on the teacher node
    follows slime's save directory with the service's key; the refresh steps (40, 80,
    120, 160 of 200) are all multiples of the save interval, which stays 20."""
    job = _opsd_job(teacher={"snapshot": "refresh"})
    steps = build_plan(job, hosts_from_config(job))
    names = [s.name for s in steps]
    assert names.index("check teacher tokenizer") < names.index("teacher snapshot sync")
    assert names.index("teacher snapshot sync") < names.index("submit")
    sync = steps[names.index("teacher snapshot sync")]
    assert sync.host == "teacher-node" and sync.kind == "background"
    assert sync.command.startswith(
        "env OPD_TEACHER_API_KEY=${OPD_TEACHER_API_KEY} opd-teacher sync"
    )
    argv = shlex.split(sync.command.split(" ", 2)[2])
    for flag, value in [
        ("--mode", "refresh"),
        ("--teacher-url", "http://127.0.0.1:8000"),
        ("--save-dir", "/shared/runs/swe-opsd/megatron"),
        ("--work-dir", "/shared/runs/swe-opsd/teacher_sync"),
        ("--origin-hf-dir", "/models/Qwen3.5-35B-A3B"),
        ("--steps", "200"),
    ]:
        assert argv[argv.index(flag) + 1] == value
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--refresh-at"] == [
        "0.2", "0.4", "0.6", "0.8",
    ]  # fmt: skip
    converter = argv[argv.index("--converter") + 1]
    assert converter.startswith(
        "cd /root/slime && PYTHONPATH=/root/Megatron-LM:/root/slime python3 "
    )
    assert "tools/convert_torch_dist_to_hf.py --input-dir {input_dir} --output-dir" in converter
    assert "steps 40, 80, 120, 160" in sync.note
    submit = steps[-1]
    assert "--save-interval 20 " in submit.command and "lowered" not in submit.note


def test_opsd_ema_plan_lowers_the_save_interval_and_says_so() -> None:
    job = _opsd_job(teacher={"snapshot": "ema", "ema_sync_every": 8, "ema_decay": 0.95})
    steps = build_plan(job, hosts_from_config(job))
    submit = steps[-1]
    assert "--save-interval 4 " in submit.command  # gcd(20, 8): every 8th step is saved
    assert "--save-interval 4 lowered from logging.save_every_steps 20" in submit.note
    sync = next(s for s in steps if s.name == "teacher snapshot sync")
    assert "--mode ema" in sync.command and "--ema-decay 0.95 --ema-every 8" in sync.command
    assert "an EMA over checkpoints" in sync.note
    dry_run = render_dry_run(steps, "/logs")
    assert f"# {submit.note}\n" in dry_run and f"# {sync.note}\n" in dry_run


def test_the_plans_sync_command_is_the_sync_clis(tmp_path: Path) -> None:
    """The flags the plan writes are the ones `opd-teacher sync` takes: run with a missing
    origin checkpoint, the CLI gets as far as checking it."""
    job = _opsd_job(
        teacher={"snapshot": "refresh", "model": str(tmp_path / "nowhere")},
        logging={"run_dir": str(tmp_path / "run")},
    )
    sync = next(s for s in build_plan(job, hosts_from_config(job)) if "sync" in s.name)
    argv = shlex.split(sync.command.split(" ", 2)[2])
    assert argv[0] == "opd-teacher"
    result = CliRunner().invoke(teacher_cli, argv[1:], env={"OPD_TEACHER_API_KEY": "k"})
    assert result.exit_code == 2
    assert "origin_hf_dir" in result.output and "no HF checkpoint" in result.output


def test_opsd_cluster_accepts_the_students_own_hint() -> None:
    job = _opsd_job(teacher={"hint": "student"})
    check_cluster(job)
    assert job.teacher.hint == "student"


def _oprd_job(**sections: Any) -> Any:
    base: dict[str, Any] = read_config_data(OPRD_EXAMPLE)
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    return config_from_dict(base)


def test_oprd_plan_serves_and_refreshes_the_snapshot_and_routes_branches_in_advantages() -> None:
    """OPRD on a cluster: the student's snapshot served as for OPSD, refreshed at 20/40/60/80%
    by `opd-teacher sync`; slime runs our reward post-process and advantage function (the
    branch carrier) with one training step per rollout, and every hook path resolves."""
    job = load_config(OPRD_EXAMPLE)
    assert job.teacher.kind == "self" and job.teacher.model == job.model.student
    steps = build_plan(job, hosts_from_config(job))
    names = [s.name for s in steps]
    assert names.index("teacher service") < names.index("wait teacher")
    assert names.index("wait teacher") < names.index("teacher snapshot sync")
    assert names.index("teacher snapshot sync") < names.index("submit")
    by_name = {s.name: s for s in steps}
    sync = by_name["teacher snapshot sync"]
    assert "--mode refresh" in sync.command and "steps 40, 80, 120, 160" in sync.note
    written = yaml.safe_load(by_name["write job config"].content)
    assert written["algorithm"]["recipe"] == "oprd"
    assert written["algorithm"]["oprd_failure_loss"] == "sampled"
    assert written["teacher"]["url"] == "http://teacher-node:8000"
    argv = shlex.split(steps[-1].command.split(" -- ", 1)[1])

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert value("--custom-reward-post-process-path") == "slime_ext.slime.oprd.post_process_rewards"
    assert value("--custom-advantage-function-path") == "slime_ext.slime.oprd.advantages"
    rollouts = job.rollout.tasks_per_step * job.rollout.samples_per_task
    assert value("--global-batch-size") == value("--rollout-batch-size") == str(rollouts)
    for refused in (
        "--normalize-advantages",
        "--use-opd",
        "--disable-compute-advantages-and-returns",
    ):
        assert refused not in argv
    for flag in (
        "--custom-generate-function-path",
        "--custom-rm-path",
        "--custom-reward-post-process-path",
        "--custom-advantage-function-path",
        "--custom-loss-function-path",
        "--custom-rollout-log-function-path",
    ):
        module, _, name = value(flag).rpartition(".")
        assert callable(getattr(importlib.import_module(module), name)), flag
    opsd = build_plan(load_config(OPSD_EXAMPLE), hosts_from_config(load_config(OPSD_EXAMPLE)))
    assert "--custom-advantage-function-path" not in opsd[-1].command


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        (
            {"algorithm": {"oprd_failure_loss": "shared_support"}},
            "algorithm.oprd_failure_loss: recipe 'oprd' on slime .* needs "
            "algorithm.oprd_failure_loss sampled or teacher_topk",
        ),
        ({"teacher": {"api_key_env": None}}, "teacher.api_key_env: teacher.snapshot 'refresh'"),
        ({"teacher": {"node": None}}, "set teacher.node .* or teacher.url"),
    ],
)
def test_oprd_cluster_checks_say_what_to_fix(sections: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_cluster(_oprd_job(**sections))


def _cluster_job(**sections: Any) -> Any:
    base: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    return config_from_dict(base)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"cluster": {"model_args_script": None}}, "cluster.model_args_script"),
        ({"cluster": {"megatron_checkpoint": None}}, "cluster.megatron_checkpoint"),
        ({"cluster": {"save_dir": None}}, "cluster.save_dir"),
        ({"cluster": {"tasks_file": None}}, "cluster.tasks_file"),
        ({"teacher": {"model": None}}, "teacher.model: the checkpoint"),
        (
            {"sandbox": {"hosts": "ray"}, "cluster": {"sandbox_hosts": []}},
            "sandbox.hosts ray: cluster.sandbox_hosts names no node",
        ),
        (
            {"sandbox": {"max_sandboxes": 16}},
            r"2 sandbox host\(s\) give 32: set sandbox.max_sandboxes: 128",
        ),
        (
            {"sandbox": {"hosts": "here", "max_sandboxes": 200}},
            r"1 sandbox host\(s\) give 200: set sandbox.max_sandboxes: 256",
        ),
    ],
)
def test_cluster_checks_say_what_to_fix(sections: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_cluster(_cluster_job(**sections))


def test_plan_says_where_swe_sandboxes_run_and_passes_the_e2b_key_by_name() -> None:
    submit = build_plan(_cluster_job(), hosts_from_config(_cluster_job()))[-1]
    assert "SWE sandboxes: docker on every Ray node offering the sandbox-host" in submit.note
    e2b = _cluster_job(sandbox={"backend": "e2b", "e2b_api_key_env": "TEAM_E2B_KEY"})
    check_cluster(e2b)  # E2B needs no sandbox hosts
    assert "TEAM_E2B_KEY" in secret_names(e2b) and "TEAM_E2B_KEY" not in secret_names(
        _cluster_job()
    )


def test_missing_nodes_are_named() -> None:
    job = _cluster_job(cluster={"workers": ["a"]})
    with pytest.raises(ConfigError, match="3 more training node"):
        hosts_from_config(job)


def _argv(job: Any) -> list[str]:
    """slime's train.py arguments of the job's plan."""
    submit = build_plan(job, hosts_from_config(job))[-1].command
    return shlex.split(submit.split(" -- ", 1)[1])


def _value(argv: list[str], flag: str) -> str:
    [index] = [i for i, token in enumerate(argv) if token == flag]
    return argv[index + 1]


@pytest.mark.parametrize("recipe", ["opd", "rl"])
def test_top_p_below_one_is_refused_where_slime_samples(recipe: str) -> None:
    """slime asserts per-sample top-p token sets for --rollout-top-p != 1 (our samples have
    none); the plan used to pass --rollout-top-p 0.9 on to it."""
    job = _cluster_job(rollout={"top_p": 0.9}, algorithm={"recipe": recipe})
    with pytest.raises(ConfigError) as caught:
        check_cluster(job)
    message = str(caught.value)
    assert "rollout.top_p 0.9: with a top-p below 1 slime asserts" in message
    assert "rollout_top_p_token_ids" in message and "set rollout.top_p: 1.0" in message


def test_opd_plus_reward_is_refused_on_a_cluster() -> None:
    job = _cluster_job(algorithm={"reward_weight": 0.5})
    with pytest.raises(ConfigError, match=r"reward_weight 0.5: OPD plus outcome .* local"):
        check_cluster(job)


def test_kl_discount_is_refused_where_a_trajectory_is_not_one_sample_on_one_rank() -> None:
    packed = {"kl_discount": 0.9, "sequence_layout": "packed"}
    check_cluster(
        _cluster_job(algorithm=packed, parallel={"cp": 1, "dp": 8, "max_tokens_per_gpu": 80000})
    )
    with pytest.raises(ConfigError, match=r"kl_discount 0.9 .* parallel.cp 2 splits"):
        check_cluster(_cluster_job(algorithm=packed))
    per_turn = {"kl_discount": 0.9, "sequence_layout": "per_turn"}
    with pytest.raises(ConfigError, match=r"kl_discount 0.9 .* the layout is per turn"):
        check_cluster(
            _cluster_job(
                algorithm=per_turn, parallel={"cp": 1, "dp": 8, "max_tokens_per_gpu": 80000}
            )
        )


def test_top_k_truncation_is_refused_where_slime_samples() -> None:
    job = _oprd_job(rollout={"top_k": 20})
    with pytest.raises(ConfigError, match=r"rollout.top_k 20: slime keeps no top-k .* -1"):
        check_cluster(job)


def _sft_job(**rollout: Any) -> Any:
    return _cluster_job(
        algorithm={"recipe": "sft"},
        rollout={"tasks_per_step": 4, "samples_per_task": 2, **rollout},
        cluster={"tasks_file": "/shared/data/sft.jsonl"},
    )


def test_sft_plan_takes_no_sampling_truncation() -> None:
    """sft / ssd train on pre-tokenized data: a top-p in the config (SSD's sampling
    setting) is no reason to refuse the job, and slime gets no --rollout-top-p / -top-k."""
    job = _sft_job(top_p=0.9, top_k=20)
    check_cluster(job)
    argv = _argv(job)
    assert "--rollout-top-p" not in argv and "--rollout-top-k" not in argv
    assert "--router-policy" not in argv  # slime's router serves no rollouts of ours


def test_sft_plan_batch_sizes_count_the_trajectories_sft_rollout_emits(tmp_path: Path) -> None:
    """With samples_per_task 2, sft_rollout emits --rollout-batch-size trajectories per step
    (one per group); slime's dp_schedule needs at least --global-batch-size rollout ids
    (each step trains global-batch-size rollouts), and the plan used to pass 4 and 8."""
    from slime_ext.sft_data import TurnRecord, write_records
    from slime_ext.slime.sft_rollout import generate_rollout
    from tests.slime_driver import sample_class

    records = tmp_path / "sft.jsonl"
    turn = {"tokens": [1, 2, 3], "response_length": 1, "loss_mask": [1]}
    write_records(
        records,
        [TurnRecord(trajectory_id=f"t{i}", turn=k, **turn) for i in range(20) for k in range(2)],
    )
    job = _sft_job()
    argv = _argv(job)
    trajectories = job.rollout.tasks_per_step * job.rollout.samples_per_task
    rollout_batch = int(_value(argv, "--rollout-batch-size"))
    per_prompt = int(_value(argv, "--n-samples-per-prompt"))
    global_batch = int(_value(argv, "--global-batch-size"))
    assert (rollout_batch, per_prompt, global_batch) == (trajectories, 1, trajectories)
    args = SimpleNamespace(
        opd_sft_data=str(records), rollout_batch_size=rollout_batch, seed=0
    )  # what sft_rollout reads of slime's args
    groups = generate_rollout(args, 0, None, sample_class=sample_class())
    assert len(groups) == rollout_batch * per_prompt  # slime's "rollout_batch_size * n"
    rollout_ids = {s.rollout_id for group in groups for turns in group for s in turns}
    assert len(rollout_ids) == global_batch  # one full training step, nothing left over
    assert "counts trajectories" in build_plan(job, hosts_from_config(job))[-1].note


def test_plan_routes_a_trajectory_to_one_rollout_engine() -> None:
    """Our rollout policy's X-SMG-Routing-Key is honoured under router policy manual;
    slime's router defaults to cache_aware."""
    for recipe in ("opd", "rl"):
        argv = _argv(_cluster_job(algorithm={"recipe": recipe}))
        assert _value(argv, "--router-policy") == "manual"
    chosen = _argv(
        _cluster_job(cluster={"extra_train_args": ["--router-policy=consistent_hashing"]})
    )
    assert "--router-policy" not in chosen  # the user's own, appended as given
    assert chosen[-1] == "--router-policy=consistent_hashing"


def test_plans_router_policy_is_one_the_sglang_router_cli_accepts() -> None:
    """slime parses --router-* with sglang-router's RouterArgs (use_router_prefix=True,
    slime/backends/sglang_utils/arguments.py); an unknown choice ends slime at startup."""
    launch_router = pytest.importorskip("sglang_router.launch_router")
    parser = argparse.ArgumentParser(add_help=False)
    launch_router.RouterArgs.add_cli_args(parser, use_router_prefix=True, exclude_host_port=True)
    argv = _argv(_cluster_job())
    index = argv.index("--router-policy")
    parsed, _ = parser.parse_known_args(argv[index : index + 2])
    assert launch_router.RouterArgs.from_cli_args(parsed, use_router_prefix=True).policy == (
        "manual"
    )


@pytest.mark.parametrize(
    ("recipe", "extra", "message"),
    [
        ("opd", ["--group-rm"], "slime then rewards each group at once"),
        ("rl", ["--allgather-cp"], "slime then splits .* contiguously"),
        ("sft", ["--calculate-per-token-loss"], "invariant 7"),
        ("opd", ["--use-opd", "--opd-type", "sglang"], "slime's own OPD \\(a KL penalty"),
        ("opd", ["--partial-rollout"], "slime then recycles"),
        ("opd", ["--loss-type", "policy_loss"], "policy_loss: the plan points it"),
        ("opd", ["--custom-loss-function-path=my.loss"], "silently replace them"),
        ("rl", ["--custom-generate-function-path", "my.gen"], "silently replace them"),
        ("rl", ["--custom-rm-path", "my.rm"], "silently replace them"),
        ("rl", ["--custom-reward-post-process-path", "my.pp"], "silently replace them"),
        ("sft", ["--rollout-function-path", "my.rollout"], "silently replace them"),
        ("opd", ["--custom-advantage-function-path", "my.adv"], "silently replace them"),
        ("opd", ["--custom-config-path", "/x.yaml"], "silently replace them"),
        ("opd", ["--custom-convert-samples-to-train-data-path", "my.c"], "teacher_log_probs"),
        ("opd", ["--rollout-temperature=0.7"], "set rollout.temperature instead"),
        ("opd", ["--rollout-top-p", "0.9"], "set rollout.top_p instead"),
        ("sft", ["--rollout-top-p", "0.9"], "slime samples nothing"),
        ("opd", ["--global-batch-size", "64"], "set rollout.tasks_per_step and"),
        ("sft", ["--rollout-batch-size", "8"], "set rollout.tasks_per_step instead"),
        ("rl", ["--n-samples-per-prompt", "8"], "set rollout.samples_per_task instead"),
        ("opd", ["--tensor-model-parallel-size", "4"], "set parallel.tp instead"),
        ("opd", ["--context-parallel-size=1"], "set parallel.cp instead"),
        ("opd", ["--num-steps-per-rollout", "2"], "one optimizer step per rollout"),
        ("opd", ["--advantage-estimator", "ppo"], "ppo trains a critic"),
        ("rl", ["--advantage-estimator", "gspo"], "differ from grpo only inside"),
        ("oprd", ["--normalize-advantages"], "recipe oprd: --normalize-advantages would"),
        ("opd", ["--router-policy", "cache_aware"], "honours only under policy manual"),
        ("opd", ["--reward-key", "score"], "sample.reward\\[key\\]"),
        ("opd", ["--use-rollout-routing-replay"], "rollout_routed_experts"),
        ("opd", ["--use-kl-loss", "--kl-loss-coef", "0.1"], "inside its own policy_loss"),
        ("rl", ["--entropy-coef", "0.01"], "inside its own policy_loss"),
        ("opd", ["--kl-coef", "0.1"], "not algorithm.kl_coef"),
        ("opd", ["--rollout-stop", "</s>"], "reaches only the sampling_params"),
        (
            "rl",
            ["--dynamic-sampling-filter-path", "slime.rollout.filter_hub.x.check"],
            "use a filter that takes lists",
        ),
    ],
)
def test_extra_train_args_that_our_hooks_cannot_honour_are_refused(
    recipe: str, extra: list[str], message: str
) -> None:
    job = _recipe_job(recipe, extra)
    flag = extra[0].partition("=")[0]
    with pytest.raises(ConfigError, match=f"cluster.extra_train_args {flag}.*{message}"):
        check_cluster(job)


@pytest.mark.parametrize(
    ("recipe", "extra"),
    [
        ("opd", ["--use-rollout-logprobs", "--keep-old-actor", "--disable-rewards-normalization"]),
        ("rl", ["--normalize-advantages", "--advantage-estimator=reinforce_plus_plus"]),
        ("rl", ["--advantage-estimator", "reinforce_plus_plus_baseline", "--kl-coef", "0.01"]),
        ("opd", ["--router-policy", "manual", "--entropy-coef", "0", "--kl-coef=0"]),
        ("oprd", ["--use-routing-replay", "--rollout-seed", "7", "--sglang-mem-fraction-static",
                  "0.7"]),
        ("sft", ["--router-policy", "cache_aware", "--recompute-granularity", "full"]),
    ],
)  # fmt: skip
def test_extra_train_args_our_hooks_honour_pass_through(recipe: str, extra: list[str]) -> None:
    job = _recipe_job(recipe, extra)
    check_cluster(job)
    assert _argv(job)[-len(extra) :] == extra


def test_flag_values_are_read_in_both_forms() -> None:
    assert given_flags(
        ["--a", "1", "--b=x=y", "--switch", "--c", "-1", "--d", "--e=", "loose", "--a", "2"]
    ) == {"--a": "2", "--b": "x=y", "--switch": None, "--c": "-1", "--d": None, "--e": ""}


def _recipe_job(recipe: str, extra: list[str] | None = None, **sections: Any) -> Any:
    """The example cluster config of the recipe (opd's example for rl, sft and ssd)."""
    if recipe == "opsd":
        return _opsd_job(**sections, cluster={"extra_train_args": extra or []})
    if recipe == "oprd":
        return _oprd_job(**sections, cluster={"extra_train_args": extra or []})
    algorithm = {"recipe": recipe, **sections.pop("algorithm", {})}
    return _cluster_job(algorithm=algorithm, cluster={"extra_train_args": extra or []}, **sections)


RECIPE_CONFIGS: dict[str, tuple[Path, list[str]]] = {
    "opd": (EXAMPLE, []),
    "opsd": (OPSD_EXAMPLE, []),
    "oprd": (OPRD_EXAMPLE, []),
    "rl": (EXAMPLE, ["algorithm.recipe=rl"]),
    "sft": (EXAMPLE, ["algorithm.recipe=sft", "rollout.samples_per_task=2"]),
    "ssd": (EXAMPLE, ["algorithm.recipe=ssd"]),
}
"""A cluster config of each recipe: an example and overrides."""


@pytest.mark.parametrize(
    ("recipe", "overrides", "refusal"),
    [
        *((recipe, [], None) for recipe in RECIPE_CONFIGS),
        ("opd", ["teacher.top_k=8", "algorithm.opd_loss=topk_tail"], None),
        ("oprd", ["algorithm.oprd_failure_loss=shared_support"], "needs algorithm.oprd"),
        ("opd", ["cluster.workers=[train-node-1]"], "3 more training node"),
        ("opd", ["rollout.top_p=0.9"], "rollout.top_p 0.9"),
        ("rl", ["rollout.top_p=0.95"], "rollout.top_p 0.95"),
        ("opsd", ["rollout.top_k=20"], "rollout.top_k 20"),
        ("sft", ["rollout.top_p=0.9"], None),
        ("ssd", ["cluster.tasks_file=null"], "cluster.tasks_file: the pre-tokenized"),
        *(
            (recipe, [f"cluster.extra_train_args={json.dumps(extra)}"], extra[0].split("=")[0])
            for recipe, extra, _ in [
                ("opd", ["--group-rm"], ""),
                ("rl", ["--allgather-cp"], ""),
                ("sft", ["--calculate-per-token-loss"], ""),
                ("opsd", ["--use-opd"], ""),
                ("oprd", ["--normalize-advantages"], ""),
                ("opd", ["--loss-type", "policy_loss"], ""),
                ("rl", ["--rollout-top-p=0.9"], ""),
                ("ssd", ["--global-batch-size", "3"], ""),
                ("opd", ["--router-policy", "round_robin"], ""),
                ("opd", ["--advantage-estimator", "ppo"], ""),
                ("opd", ["--partial-rollout"], ""),
            ]
        ),
        ("opd", ['cluster.extra_train_args=["--use-rollout-logprobs"]'], None),
        # the layout the plan resolves: refused by validate as by the plan
        ("sft", ["algorithm.sequence_layout=packed"], "recipes sft and ssd train slime on"),
        ("sft", ["algorithm.sequence_layout=per_turn"], None),
        (
            "opd",
            [
                "model.student=/models/Falcon-H1-7B",
                "cluster.model_args_script=scripts/models/falcon-h1-7B.sh",
                "algorithm.sequence_layout=packed",
            ],
            "Falcon-H1-7B names a recurrent or hybrid family",
        ),
        # the hardware: the teacher's SGLang TP within its node, disaggregated engines
        ("opd", ["teacher.tp=16"], "teacher.tp 16: SGLang's tensor parallelism stays within"),
        ("opsd", ["teacher.tp=8"], "set teacher.tp to one of 1, 2, 4"),
        ("opd", ["teacher.tp=4"], None),
        (
            "opd",
            ["parallel.colocate=false", "parallel.rollout_gpus=4"],
            "the rollout engines' 4 GPUs .* 20 in all, but Ray offers 16",
        ),
        (
            "opd",
            [
                "parallel.colocate=false",
                "parallel.rollout_gpus=4",
                'cluster.ray_start_args=["--num-gpus", "8"]',
            ],
            None,
        ),
        (
            "opd",
            [
                "parallel.colocate=false",
                "parallel.rollout_gpus=3",
                "cluster.ray_start_args=[--num-gpus=8]",
            ],
            "rollout_gpus 3 is not a multiple of the GPUs of one rollout engine",
        ),
        # the context budget against the teacher's limit
        (
            "opd",
            ['teacher.serve_args=["--max-context", "65536"]'],
            "65536 \\+ max_new_tokens 12288 = 77824 is above the teacher's --max-context",
        ),
        ("opd", ['teacher.serve_args=["--max-context", "77824"]'], None),
        # the teacher's key
        ("opd", ["teacher.api_key_env=null"], "teacher.api_key_env: a cluster teacher answers"),
        ("oprd", ["teacher.api_key_env=null"], "teacher.unauthenticated: true to score"),
        ("opd", ["teacher.api_key_env=null", "teacher.unauthenticated=true"], None),
        ("rl", ["teacher.api_key_env=null"], None),  # no teacher, no key
    ],
)
def test_validate_accepts_a_cluster_config_iff_launch_dry_run_does(
    recipe: str, overrides: list[str], refusal: str | None
) -> None:
    """`opd config validate` runs the checks of `opd launch` (the same functions): it
    accepts exactly what the dry run accepts, and a refusal names the same problems."""
    path, base = RECIPE_CONFIGS[recipe]
    sets = [arg for item in [*base, *overrides] for arg in ("--set", item)]
    validate = CliRunner().invoke(app, ["config", "validate", str(path), *sets])
    dry_run = CliRunner().invoke(app, ["launch", str(path), *sets, "--dry-run"])
    assert (validate.exit_code, dry_run.exit_code) in [(0, 0), (2, 2)], (
        validate.output + dry_run.output
    )
    if refusal is None:
        assert validate.exit_code == 0, validate.output
        assert validate.output.startswith(f"ok for opd launch: {path}: recipe {recipe}")
        return
    assert validate.output.startswith(f"not ready for opd launch: {path}\n")
    assert dry_run.output.startswith(f"cannot launch: {path}\n")
    problems = validate.output.split("\n", 1)[1]
    assert problems == dry_run.output.split("\n", 1)[1]
    assert re.search(refusal, problems), problems


@pytest.mark.parametrize(
    ("config", "settings"),
    [
        (EXAMPLE, ["teacher.top_k=32", "algorithm.opd_loss=topk_tail"]),
        (OPSD_EXAMPLE, ["teacher.top_k=8", "algorithm.opd_loss=topk_renorm"]),
        (OPRD_EXAMPLE, ["teacher.top_k=8", "algorithm.oprd_failure_loss=teacher_topk"]),
    ],
    ids=["opd", "opsd", "oprd"],
)
def test_dry_run_runs_top_k_losses_on_slime_with_the_hook_that_carries_the_rows(
    config: Path, settings: list[str]
) -> None:
    """A top-k loss launches: slime's Megatron ranks get tree.init (which extends the
    training step's batch keys with the rows), the teacher service accepts the job's top_k;
    a sampled loss of a per-turn job adds nothing."""
    per_turn = ["--set", "algorithm.sequence_layout=per_turn"]
    sets = [arg for item in settings for arg in ("--set", item)] + per_turn
    topk = CliRunner().invoke(app, ["launch", str(config), *sets, "--dry-run"])
    assert topk.exit_code == 0, topk.output
    assert "--custom-megatron-init-path slime_ext.slime.tree.init" in topk.output
    sampled = CliRunner().invoke(app, ["launch", str(config), *per_turn, "--dry-run"])
    assert sampled.exit_code == 0 and "--custom-megatron-init-path" not in sampled.output
    if config == EXAMPLE:
        wide = ["--set", "teacher.top_k=128", "--set", "algorithm.opd_loss=topk_tail"]
        plan = CliRunner().invoke(app, ["launch", str(config), *wide, "--dry-run"])
        assert plan.exit_code == 0 and "--max-top-k 128" in plan.output


def test_sbatch_takes_its_nodes_from_the_allocation(tmp_path: Path) -> None:
    """The one launch check validate makes that --sbatch skips: the hosts in the config."""
    script = tmp_path / "job.sbatch"
    args = ["launch", str(EXAMPLE), "--set", "cluster.workers=[]", "--set", "cluster.head=null"]
    assert CliRunner().invoke(app, [*args, "--sbatch", str(script)]).exit_code == 0
    assert "$NODE_3" in script.read_text()
    refused = CliRunner().invoke(app, [*args, "--dry-run"])
    assert refused.exit_code == 2 and "--sbatch` takes the nodes" in refused.output


def test_one_pass_lists_the_configs_problems_and_the_launchs_beside_them() -> None:
    """A config with invalid values and problems only the launch checks see: validate and
    launch name both at once (the invalid keys left at their defaults for the second), so
    fixing the first set does not reveal a second; a refusal of a whole section stops at
    the first set (no key to leave out)."""
    sets = [
        "--set", "rollout.max_turns=0", "--set", "teacher.api_key_env=null",
        "--set", "rollout.top_k=5",
    ]  # fmt: skip
    for argv in (
        ["config", "validate", str(EXAMPLE), *sets],
        ["launch", str(EXAMPLE), *sets, "--dry-run"],
    ):
        result = CliRunner().invoke(app, argv)
        text = " ".join(result.output.split())
        assert result.exit_code == 2
        assert "rollout.max_turns: Input should be greater than or equal to 1 (got 0)" in text
        assert "checked with rollout.max_turns at their defaults" in text
        assert "teacher.api_key_env: a cluster teacher answers" in text
        assert "rollout.top_k 5: slime keeps no top-k token sets" in text
    whole = CliRunner().invoke(app, ["config", "validate", str(EXAMPLE), "--set", "parallel.tp=3"])
    assert whole.exit_code == 2 and "does not divide" in whole.output
    assert "refuses in the rest of it" not in whole.output
    # without its GPU count the config would be checked for another command: not at all
    gpus = ["--set", "parallel.gpus_per_node=eight", "--set", "teacher.api_key_env=null"]
    other = CliRunner().invoke(app, ["config", "validate", str(EXAMPLE), *gpus])
    assert other.exit_code == 2 and "refuses in the rest of it" not in other.output


def test_a_slurm_config_without_nodes_is_for_sbatch_and_validate_says_so(tmp_path: Path) -> None:
    """executor srun with no node named: the allocation's nodes are the job's, so validate
    checks it for `opd launch --sbatch` (which accepts it) and a plain launch refuses it,
    naming --sbatch; over ssh the same config is refused by validate too."""
    nodes = ["--set", "cluster.workers=[]", "--set", "cluster.head=null"]
    srun = [str(EXAMPLE), *nodes, "--set", "cluster.executor=srun"]
    validate = CliRunner().invoke(app, ["config", "validate", *srun])
    assert validate.exit_code == 0, validate.output
    assert validate.output.startswith(f"ok for opd launch --sbatch: {EXAMPLE}: recipe opd")
    script = tmp_path / "job.sbatch"
    assert CliRunner().invoke(app, ["launch", *srun, "--sbatch", str(script)]).exit_code == 0
    plain = CliRunner().invoke(app, ["launch", *srun, "--dry-run"])
    assert plain.exit_code == 2 and "--sbatch` takes the nodes" in plain.output
    ssh = CliRunner().invoke(app, ["config", "validate", str(EXAMPLE), *nodes])
    assert ssh.exit_code == 2 and ssh.output.startswith("not ready for opd launch:")


def _student_dir(tmp_path: Path, max_positions: int, **config: Any) -> Path:
    """A student directory whose config.json is readable here (a Qwen3 config)."""
    student = tmp_path / "student"
    student.mkdir()
    data = {"model_type": "qwen3", "max_position_embeddings": max_positions, **config}
    (student / "config.json").write_text(json.dumps(data))
    return student


def test_the_context_budget_is_checked_against_a_readable_students_limit(tmp_path: Path) -> None:
    """A student whose config.json says 32768 positions cannot take 65536 + 12288; one
    with 131072 can; the validate line names the layout the plan resolved and why."""
    short = _student_dir(tmp_path, 32768)
    sets = ["--set", f"model.student={short}", "--set", "cluster.model_args_script=x.sh"]
    refused = CliRunner().invoke(app, ["config", "validate", str(EXAMPLE), *sets])
    assert refused.exit_code == 2
    assert (
        "rollout.max_context_tokens 65536 + max_new_tokens 12288 = 77824 is above the "
        f"student's max_position_embeddings 32768 ({short}/config.json): lower "
        "rollout.max_context_tokens to at most 20480"
    ) in " ".join(refused.output.split())
    dry_run = CliRunner().invoke(app, ["launch", str(EXAMPLE), *sets, "--dry-run"])
    assert dry_run.exit_code == 2 and "max_position_embeddings 32768" in dry_run.output
    shutil.rmtree(short)
    long = _student_dir(tmp_path, 131072)
    sets[1] = f"model.student={long}"
    ok = CliRunner().invoke(app, ["config", "validate", str(EXAMPLE), *sets])
    assert ok.exit_code == 0, ok.output
    assert "sequence layout packed (auto: the student is full-attention (its config.json))" in (
        " ".join(ok.output.split())
    )
    assert "warning" not in ok.output


def test_a_student_the_plan_cannot_see_is_a_warning_naming_the_setting() -> None:
    """auto falls back to per turn for a student whose config.json is not readable here:
    validate and launch say so as a warning (it is not a refusal) with the setting."""
    sets = [
        "--set", "model.student=/models/Llama-3-8B",
        "--set", "cluster.model_args_script=scripts/models/llama3-8B.sh",
    ]  # fmt: skip
    for argv in (
        ["config", "validate", str(EXAMPLE), *sets],
        ["launch", str(EXAMPLE), *sets, "--dry-run"],
    ):
        result = CliRunner().invoke(app, argv)
        assert result.exit_code == 0, result.output
        text = " ".join(result.output.split())
        assert (
            "warning: the sequence layout is per turn because /models/Llama-3-8B/config.json"
            in text
        )
        assert "set algorithm.sequence_layout: packed" in text
    explicit = [*sets, "--set", "algorithm.sequence_layout=packed"]
    quiet = CliRunner().invoke(app, ["config", "validate", str(EXAMPLE), *explicit])
    assert quiet.exit_code == 0 and "warning" not in quiet.output
    assert "sequence layout packed (algorithm.sequence_layout packed)" in quiet.output


def test_a_launch_refuses_an_unset_key_variable_and_the_batch_script_stops_on_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job's secrets are read by name: `opd launch` refuses to start while one is unset
    here, and the batch script stops at its first line when one is unset where it runs."""
    monkeypatch.delenv("OPD_TEACHER_API_KEY", raising=False)
    launch = CliRunner().invoke(app, ["launch", str(EXAMPLE)])
    assert launch.exit_code == 2
    assert "OPD_TEACHER_API_KEY is unset here: export it before `opd launch`" in launch.output
    assert CliRunner().invoke(app, ["launch", str(EXAMPLE), "--dry-run"]).exit_code == 0
    script = tmp_path / "job.sbatch"
    assert CliRunner().invoke(app, ["launch", str(EXAMPLE), "--sbatch", str(script)]).exit_code == 0
    env = {k: v for k, v in os.environ.items() if k != "OPD_TEACHER_API_KEY"}
    env["PATH"] = str(tmp_path / "nothing")  # scontrol and srun are never reached
    ran = subprocess.run(
        ["/bin/bash", str(script)], env=env, capture_output=True, text=True, timeout=30
    )
    assert ran.returncode != 0
    assert "OPD_TEACHER_API_KEY is unset: export it where sbatch runs" in ran.stderr
    assert not (tmp_path / "runs").exists()


def test_a_teacher_without_a_key_on_purpose_binds_its_nodes_address_only(tmp_path: Path) -> None:
    sets = ["--set", "teacher.api_key_env=null", "--set", "teacher.unauthenticated=true"]
    plan = CliRunner().invoke(app, ["launch", str(EXAMPLE), *sets, "--dry-run"])
    assert plan.exit_code == 0, plan.output
    text = " ".join(plan.output.split())
    assert (
        "opd-teacher serve --backend sglang --model /models/Qwen3.5-27B --host teacher-node" in text
    )
    assert "anyone who can reach teacher-node:8000 can score with it" in text
    assert "0.0.0.0 --port 8000" not in text and "OPD_TEACHER_API_KEY" not in text
    script = tmp_path / "job.sbatch"
    assert (
        CliRunner().invoke(app, ["launch", str(EXAMPLE), *sets, "--sbatch", str(script)]).exit_code
        == 0
    )
    assert "--host $ADDR_4 --port 8000" in script.read_text()
    both = CliRunner().invoke(
        app, ["config", "validate", str(EXAMPLE), "--set", "teacher.unauthenticated=true"]
    )
    assert both.exit_code == 2 and "remove one of them" in both.output


def test_the_batch_scripts_tokenizer_check_compares_the_services_tokenizer(
    factory_dir: Path, tmp_path: Path
) -> None:
    """launch/check_teacher.py (the batch script's step): exit 0 when the service's
    tokenizer is the student's, 1 naming the difference, 1 without an identity; a student
    not readable on the node is said and passes."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from launch import check_teacher

    served: dict[str, Any] = {
        "tokenizer": local_tokenizer_identity(str(factory_dir)),
        "max_context": 4096,
    }
    seen: list[str | None] = []

    class Info(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization"))
            body = json.dumps(served).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Info)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/info"
    try:
        os.environ["CHECK_TEACHER_KEY"] = "k1"
        args = [
            "--info-url",
            url,
            "--student",
            str(factory_dir),
            "--api-key-env",
            "CHECK_TEACHER_KEY",
        ]
        assert check_teacher.main(args) == 0 and seen[-1] == "Bearer k1"
        assert check_teacher.main([*args, "--context-budget", "4096"]) == 0
        assert check_teacher.main([*args, "--context-budget", "4097"]) == 1  # 413s ahead
        copy = tmp_path / "other"
        shutil.copytree(factory_dir, copy)
        data = json.loads((copy / "tokenizer.json").read_text())
        vocab = data["model"]["vocab"]
        token = next(iter(vocab))
        vocab[token + "x"] = vocab.pop(token)
        (copy / "tokenizer.json").write_text(json.dumps(data))
        served["tokenizer"] = local_tokenizer_identity(str(copy))
        assert check_teacher.main(args) == 1
        unreadable = ["--info-url", url, "--student", str(tmp_path / "nowhere")]
        assert check_teacher.main(unreadable) == 0
        served.clear()
        assert check_teacher.main(args) == 1
    finally:
        os.environ.pop("CHECK_TEACHER_KEY", None)
        server.shutdown()


def test_tokenizers_are_compared_by_content(factory_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(factory_dir, copy)
    same = local_tokenizer_identity(str(copy))
    original = local_tokenizer_identity(str(factory_dir))
    assert same is not None and original is not None and same != original  # names differ
    check_tokenizers(original, same)
    tokenizer_json = copy / "tokenizer.json"
    data = json.loads(tokenizer_json.read_text())
    vocab = data["model"]["vocab"]
    token = next(iter(vocab))
    vocab[token + "x"] = vocab.pop(token)
    tokenizer_json.write_text(json.dumps(data))
    changed = local_tokenizer_identity(str(copy))
    with pytest.raises(ConfigError, match="differs from the student's"):
        check_tokenizers(original, changed)


def _fake_cluster(
    tmp_path: Path, factory_dir: Path, monkeypatch: pytest.MonkeyPatch, fail_on: str = ""
) -> tuple[Any, Path]:
    """Executables for the fake cluster, and a job that uses them."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    trace = tmp_path / "trace.log"
    (bin_dir / "fake-ssh").write_text(
        # a daemon's liveness check (the executor's, every WATCH_S while a step runs: on a
        # loaded machine any number of them) is traced apart from the plan's own calls
        '#!/bin/bash\nhost="$1"; shift\nkind=HOST\n'
        'if [[ "$*" == *"then exit 0; fi"* ]]; then kind=CHECK; fi\n'
        'echo "$kind $host" >> "$TRACE"\nexec bash -c "$*"\n'
    )
    (bin_dir / "ray").write_text(
        '#!/bin/bash\necho "ray $*" >> "$TRACE"\n'
        'if [ -n "$FAIL_ON" ] && [[ "$*" == *"$FAIL_ON"* ]]; then\n'
        '  echo "ray: could not reach the head node" >&2; exit 3\nfi\n'
        # a node's Ray runs until stopped, as `ray start --block` does (one that ended would
        # fail the launch at the daemons' next check, on a loaded machine before the end)
        'if [[ " $* " == *" --block "* ]]; then exec sleep 600; fi\n'
    )
    (bin_dir / "torchrun").write_text('#!/bin/bash\necho "torchrun $*" >> "$TRACE"\n')
    # the plan's Ray waits are recorded, not run (the fake ray starts no cluster)
    (bin_dir / "python3").write_text(
        '#!/bin/bash\nif [ "$1 $2" = "-m launch.wait_ray" ]; then echo "wait_ray $*" >> "$TRACE"\n'
        '  if [ -n "$FAIL_ON" ] && [[ "$*" == *"$FAIL_ON"* ]]; then\n'
        '    echo "ray at node-0:6379: 2 of 3 nodes alive after 600 s" >&2; exit 1\n  fi\n'
        f'  exit 0\nfi\nexec {sys.executable} "$@"\n'
    )
    for script in bin_dir.iterdir():
        script.chmod(0o755)
    slime = tmp_path / "slime/scripts/models"
    slime.mkdir(parents=True)
    (slime / "tiny.sh").write_text("MODEL_ARGS=(--num-layers 2 --hidden-size 64)\n")
    port = free_port()
    job = config_from_dict(
        {
            "model": {"student": str(factory_dir)},
            "parallel": {"num_nodes": 2, "gpus_per_node": 1, "max_tokens_per_gpu": 8192},
            "teacher": {
                "kind": "remote",
                "model": "factory:qwen3-tiny",
                "node": "127.0.0.1",
                "port": port,
                "url": f"http://127.0.0.1:{port}",
                "api_key_env": "FAKE_TEACHER_KEY",
                "serve_args": ["--host", "127.0.0.1", "--device", "cpu", "--dtype", "float32"],
            },
            "logging": {"run_dir": str(tmp_path / "run"), "wandb_mode": "disabled"},
            "cluster": {
                "executor": "ssh",
                "ssh_command": [str(bin_dir / "fake-ssh")],
                "remote_shell": ["bash", "-c"],
                "head": "node-0",
                "workers": ["node-1"],
                "sandbox_hosts": ["cpu-0"],
                "slime_dir": str(tmp_path / "slime"),
                "model_args_script": "scripts/models/tiny.sh",
                "megatron_checkpoint": str(tmp_path / "ckpt"),
                "save_dir": str(tmp_path / "save"),
                "tasks_file": str(tmp_path / "tasks.jsonl"),
            },
        }
    )
    os.environ["PATH"] = (
        f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}" + (os.environ["PATH"])
    )
    os.environ["TRACE"] = str(trace)
    os.environ["FAIL_ON"] = fail_on
    monkeypatch.setenv("FAKE_TEACHER_KEY", "s3cret")
    standin_tasks(tmp_path / "tasks.jsonl")
    return job, trace


def _stop_teacher(port: int) -> None:
    _stop_processes(f"opd-teacher serve .*--port {port}")


def _stop_processes(command_pattern: str) -> None:
    """The background services a test's plan started (the pattern names its port or
    temporary directory)."""
    found = subprocess.run(["pgrep", "-f", command_pattern], capture_output=True, text=True)
    for pid in found.stdout.split():
        os.kill(int(pid), signal.SIGTERM)


@pytest.mark.timeout(240)
def test_launch_runs_the_plan_in_order_on_a_fake_cluster(
    tmp_path: Path, factory_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job, trace = _fake_cluster(tmp_path, factory_dir, monkeypatch)
    steps = build_plan(job, hosts_from_config(job))
    lines: list[str] = []
    # checks every 2 s (not WATCH_S): they happen on any machine, and must not disturb the order
    executor = Executor(job, report=lines.append, wait_timeout_s=180, watch_s=2.0)
    try:
        executor.run(steps)
        log = trace.read_text().splitlines()
    finally:
        executor.stop(steps, quiet=True)  # the pruner and the teacher: by their pid files
        _stop_teacher(job.teacher.port)
    hosts = [line.removeprefix("HOST ") for line in log if line.startswith("HOST ")]
    daemons = [s.host for s in steps if s.kind == "background"]
    checked = {line.removeprefix("CHECK ") for line in log if line.startswith("CHECK ")}
    assert checked and checked <= set(daemons)
    # an earlier launch's leftovers, checked (all at once: in any order)
    assert sorted(hosts[: len(daemons)]) == sorted(daemons)
    started = hosts[len(daemons) :]
    started[7:9] = sorted(started[7:9], reverse=True)  # two nodes join Ray side by side
    assert started == [
        "node-0",
        "node-0",
        "node-1",
        "127.0.0.1",
        "node-0",
        "node-0",
        "node-0",
        "node-1",
        "cpu-0",
        "node-0",
        "node-0",
        "node-0",
    ]  # fmt: skip (relaunch check, paths, teacher, convert, Ray, pruner, submit)
    rays = [line for line in log if line.startswith("ray ")]
    assert rays[0].startswith("ray start --block --head --node-ip-address node-0")
    # the two joining nodes start side by side: their fake rays trace in either order
    joins = sorted(rays[1:3], key=lambda line: '"opd_sandbox_host": 1' in line)
    assert joins[0].startswith("ray start --block --address node-0:6379 --node-ip-address node-1")
    assert joins[1].startswith("ray start --block --address node-0:6379 --node-ip-address cpu-0")
    assert '"opd_sandbox_host": 1' in joins[1] and '"opd_sandbox_host"' not in joins[0]
    assert rays[3].startswith("ray job submit --address http://127.0.0.1:8265 --no-wait")
    waits = [line for line in log if line.startswith("wait_ray ")]
    assert [w.split("--nodes ")[1] for w in waits] == ["1", "3"]  # the head, then everyone
    assert log.index(waits[0]) < log.index(rays[1]) and log.index(waits[1]) < log.index(rays[3])
    assert "/slime/train.py --num-layers 2 --hidden-size 64 --actor-num-nodes 2" in rays[3]
    assert any(line.startswith("torchrun --nproc-per-node 1") for line in log)  # converted
    assert (tmp_path / "run/job.yaml").is_file() and (tmp_path / "run/hooks.yaml").is_file()
    assert (tmp_path / "run/logs/teacher-service.log").is_file()
    assert any("check teacher tokenizer" in line for line in lines)


@pytest.mark.timeout(120)
def test_a_node_that_does_not_share_the_jobs_paths_stops_the_launch_before_anything_starts(
    tmp_path: Path, factory_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing is copied to the nodes: each training node checks it sees what the launch
    wrote (the same job config), the tasks file and the student, and can write save_dir."""
    job, trace = _fake_cluster(tmp_path, factory_dir, monkeypatch)
    (tmp_path / "tasks.jsonl").unlink()  # as on a node that does not mount it
    steps = build_plan(job, hosts_from_config(job))
    with pytest.raises(LaunchError, match="'check shared paths' on node-0") as raised:
        Executor(job, report=lambda _: None, wait_timeout_s=30).run(steps)
    message = str(raised.value)
    assert f"node node-0 does not share the job's paths:\n  {tmp_path}/tasks.jsonl: not there" in (
        message
    )
    assert "a filesystem that all nodes mount at the same path" in message
    assert not any(line.startswith("ray ") for line in trace.read_text().splitlines())


def test_a_node_seeing_another_job_config_is_refused(tmp_path: Path) -> None:
    """A node-local job.yaml (an older run's, or a copy) would train another config."""
    from launch.shared_paths import digest, problems

    config, written = tmp_path / "job.yaml", "algorithm:\n  lr: 1e-6\n"
    config.write_text(written)
    save = tmp_path / "save"
    assert problems([f"{config}={digest(written)}"], [], [str(save)]) == []
    config.write_text("algorithm:\n  lr: 1e-5\n")
    found = problems([f"{config}={digest(written)}"], [], [])
    assert found and "another file than the one opd launch wrote" in found[0]
    save.chmod(0o500)  # the write check made it
    try:
        if os.geteuid() != 0:  # root writes anywhere: the check is for a real user's mount
            assert "not writable" in problems([], [], [str(save)])[0]
    finally:
        save.chmod(0o700)


@pytest.mark.timeout(240)
def test_opsd_launch_serves_the_students_checkpoint_with_the_reload_key(
    tmp_path: Path, factory_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kind self on the fake cluster: the teacher node's opd-teacher serves the student's own
    HF checkpoint, scores only with the API key, and takes a reload with it."""
    job, _ = _fake_cluster(tmp_path, factory_dir, monkeypatch)
    teacher = job.teacher.model_dump(exclude={"kind", "model", "url"})
    job = config_from_dict(
        {
            **job.model_dump(mode="json"),
            "teacher": {**teacher, "kind": "self", "api_key_env": "FAKE_TEACHER_KEY"},
            "algorithm": {"recipe": "opsd"},
        }
    )
    assert job.teacher.model == str(factory_dir)  # the student's initial checkpoint
    monkeypatch.setenv("FAKE_TEACHER_KEY", "s3cret")
    steps = [s for s in build_plan(job, hosts_from_config(job)) if "teacher" in s.name]
    assert [s.name for s in steps] == ["teacher service", "wait teacher", "check teacher tokenizer"]
    url = f"http://127.0.0.1:{job.teacher.port}"
    try:
        Executor(job, report=lambda _: None, wait_timeout_s=180).run(steps)
        info = httpx.get(f"{url}/v1/info", headers={"Authorization": "Bearer s3cret"}).json()
        assert info["model"] == str(factory_dir)
        item = {"input_ids": [1, 2, 3, 4], "span_start": 2}
        unauthorized = httpx.post(f"{url}/v1/score", json={"requests": [item]})
        assert unauthorized.status_code == 401
        reload = httpx.post(
            f"{url}/v1/reload",
            json={"model_dir": str(factory_dir)},
            headers={"Authorization": "Bearer s3cret"},
            timeout=60,
        )
        assert reload.status_code == 200, reload.text
    finally:
        _stop_teacher(job.teacher.port)


@pytest.mark.timeout(240)
def test_opsd_refresh_launch_reloads_the_teacher_from_a_checkpoint_with_a_standin_converter(
    tmp_path: Path, factory_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """snapshot refresh on the fake cluster: the teacher node's `opd-teacher sync` (started
    by the plan, with the key) finds slime's checkpoint of the refresh step, converts it
    and has the real `opd-teacher serve` reload it, then exits."""
    job, _ = _fake_cluster(tmp_path, factory_dir, monkeypatch)
    teacher = job.teacher.model_dump(exclude={"kind", "model", "url"})
    work = tmp_path / "run/teacher_sync"
    job = config_from_dict(
        {
            **job.model_dump(mode="json"),
            "teacher": {
                **teacher,
                "kind": "self",
                "api_key_env": "FAKE_TEACHER_KEY",
                "snapshot": "refresh",
                "refresh_at": [0.5],
                "snapshot_converter": converter_standin.command(),
            },
            "algorithm": {"recipe": "opsd", "steps": 4},
        }
    )
    monkeypatch.setenv("FAKE_TEACHER_KEY", "s3cret")
    weights = load_file(factory_dir / "model.safetensors")
    converter_standin.write_checkpoint(
        tmp_path / "save", 2, {k: v + 0.01 for k, v in weights.items()}
    )
    steps = [s for s in build_plan(job, hosts_from_config(job)) if "teacher" in s.name]
    assert [s.name for s in steps][-1] == "teacher snapshot sync"
    url = f"http://127.0.0.1:{job.teacher.port}"
    try:
        Executor(job, report=lambda _: None, wait_timeout_s=180).run(steps)
        deadline = time.monotonic() + 120
        while not (work / "state.json").is_file() and time.monotonic() < deadline:
            time.sleep(0.2)
        log = (tmp_path / "run/logs/teacher-snapshot-sync.log").read_text()
        assert json.loads((work / "state.json").read_text())["applied"] == [2], log
        info = httpx.get(f"{url}/v1/info", headers={"Authorization": "Bearer s3cret"}).json()
        assert info["model"] == str(work / "converted/step_00002")
    finally:
        _stop_processes(f"opd-teacher sync .*{work}")
        _stop_teacher(job.teacher.port)


@pytest.mark.timeout(240)
def test_launch_stops_at_the_first_failing_step_and_says_so(
    tmp_path: Path, factory_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job, trace = _fake_cluster(tmp_path, factory_dir, monkeypatch, fail_on="--nodes 3")
    job = job.model_copy(
        update={"teacher": job.teacher.model_copy(update={"node": None})}
    )  # a teacher started by someone else: here, none is running
    steps = build_plan(job, Hosts("node-0", ["node-1"], None, ["cpu-0"]))
    # no teacher answers: the wait fails first, and nothing after it runs
    with pytest.raises(LaunchError, match=r"step 6/\d+ 'wait teacher' on local failed"):
        Executor(job, report=lambda _: None, wait_timeout_s=2).run(steps)
    # only the check for an earlier launch's daemons reached the nodes
    assert all(line.startswith("HOST ") for line in trace.read_text().splitlines())
    # skip the teacher: a node's Ray never joins (its daemon step failed), the wait for the
    # whole cluster says so, the submit never runs
    steps = [s for s in steps if "teacher" not in s.name]
    with pytest.raises(LaunchError) as caught:
        Executor(job, report=lambda _: None).run(steps)
    message = str(caught.value)
    assert "'wait ray cluster' on node-0 failed: exit code 1" in message
    assert "2 of 3 nodes alive" in message and "were not run" in message
    assert "job submit" not in trace.read_text()


def test_dry_run_names_every_host_and_command() -> None:
    job = load_config(EXAMPLE)
    text = render_dry_run(build_plan(job, hosts_from_config(job)), "/logs")
    assert text.count("# ") >= 15
    assert "@ teacher-node (background)" in text and "@ train-node-3 (background)" in text
    assert "ray start --block --address train-node-0:6379 --node-ip-address train-node-3" in text


def test_wait_ray_gives_up_at_its_deadline_with_what_it_saw(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from launch.wait_ray import main as wait_ray

    started = time.monotonic()
    assert (
        wait_ray(["--address", f"127.0.0.1:{free_port()}", "--nodes", "2", "--timeout-s", "2"]) == 1
    )
    assert time.monotonic() - started < 30
    assert "0 of 2 nodes alive after 2 s" in capsys.readouterr().err
    time.sleep(13)  # past the watchdog's deadline: it was cancelled, this process lives on


FAKE_RAY = """
import os, sys
MARK = os.environ["FAKE_RAY_MARK"]
_up = False
def is_initialized():
    return _up
def init(**kwargs):
    global _up
    if not os.path.exists(MARK):  # the first driver: ended from "C++", as Ray's core worker does
        open(MARK, "w").close()
        sys.stderr.write("Failed to register worker to Raylet\\n")
        sys.stderr.flush()
        os._exit(134)
    _up = True
def nodes():
    return [{"Alive": True, "NodeManagerAddress": f"10.0.0.{i}", "Resources": {"CPU": 2.0}}
            for i in (1, 2)]
"""


@pytest.mark.timeout(120)
def test_wait_ray_counts_a_driver_that_ray_ends_as_one_failed_attempt(tmp_path: Path) -> None:
    """Ray's stand-in here only ends its process on the first connect, as the real core
    worker does when the head dies mid-connect (seen under Slurm); the second attempt
    finds the nodes."""
    import socket

    (tmp_path / "ray").mkdir()
    (tmp_path / "ray/__init__.py").write_text(FAKE_RAY)
    with socket.socket() as head:  # the GCS port answers
        head.bind(("127.0.0.1", 0))
        head.listen()
        address = f"127.0.0.1:{head.getsockname()[1]}"
        command = ["--address", address, "--nodes", "2", "--timeout-s", "60"]
        done = subprocess.run(
            [sys.executable, "-m", "launch.wait_ray", *command],
            capture_output=True,
            text=True,
            timeout=90,
            cwd=tmp_path,  # the child finds launch/ without the caller's cwd
            env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{Path.cwd()}"}
            | {"FAKE_RAY_MARK": str(tmp_path / "crashed")},
        )
    assert (tmp_path / "crashed").exists()
    assert done.returncode == 0, done.stderr
    assert "2 nodes alive" in done.stdout and "10.0.0.2: CPU 2, GPU 0" in done.stdout


def _daemons_of(marker: str) -> list[str]:
    found = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    return found.stdout.split()


@pytest.mark.timeout(120)
def test_launch_stops_its_daemons_on_failure_and_an_earlier_launchs_before_starting(
    tmp_path: Path,
) -> None:
    """Background steps leave a pid file; a failing step stops the daemons started before
    it; a relaunch first stops what the previous launch left (no manual cleanup); --stop
    ends them (reported last started first); a pid file whose process is not the one started (a
    reused pid) is left alone."""
    marker = f"sleep {random.randrange(10**6, 10**7)}"
    job = config_from_dict(
        {
            "logging": {"run_dir": str(tmp_path / "run"), "wandb_mode": "disabled"},
            "cluster": {"executor": "local", "remote_shell": ["bash", "-c"]},
        }
    )
    daemon = Step("sleeper", "localhost", marker, "background")
    failing = Step("broken", "localhost", "echo nope >&2; exit 4")
    fine = Step("fine", "localhost", "true")
    lines: list[str] = []
    executor = Executor(job, report=lines.append)
    try:
        with pytest.raises(LaunchError, match="daemons it had started were stopped"):
            executor.run([daemon, failing])
        assert _daemons_of(marker) == []
        executor.run([daemon, fine])
        [first] = _daemons_of(marker)
        executor.run([daemon, fine])  # a relaunch: the earlier daemon is stopped first
        [second] = _daemons_of(marker)
        assert second != first
        assert executor.stop([daemon, fine]) == ["sleeper @ localhost"]
        assert _daemons_of(marker) == [] and not (tmp_path / "run/logs/sleeper.pid").exists()
        bystander = subprocess.Popen(["sleep", "300"])
        (tmp_path / "run/logs/sleeper.pid").write_text(
            f"{bystander.pid} Mon Jan  1 00:00:00 2001\n"
        )
        assert executor.stop([daemon]) == [] and bystander.poll() is None
        bystander.kill()
        bystander.wait()
    finally:
        for pid in _daemons_of(marker):
            os.kill(int(pid), signal.SIGKILL)


@pytest.mark.timeout(120)
def test_what_a_stopped_daemon_started_and_left_is_stopped_after_it(tmp_path: Path) -> None:
    """A daemon's descendants that outlive its exit (Ray's agents after `ray start --block`
    was killed on a loaded node) are killed a few seconds later; a process of the same
    host that the daemon did not start is left alone."""
    token = random.randrange(10**6, 10**7)
    job = config_from_dict(
        {
            "logging": {"run_dir": str(tmp_path / "run"), "wandb_mode": "disabled"},
            "cluster": {"executor": "local", "remote_shell": ["bash", "-c"]},
        }
    )
    body = (  # a child, a grandchild in its own session, and a TERM that leaves them
        f"sleep {token}1 & setsid bash -c 'sleep {token}2; :' & "
        "trap 'exit 0' TERM; while true; do sleep 0.1; done"
    )
    daemon = Step("node", "localhost", "bash -c " + shlex.quote(body), "background")
    bystander = subprocess.Popen(["sleep", f"{token}3"])
    executor = Executor(job, report=lambda line: None)
    try:
        executor.run([daemon, Step("job", "localhost", "true")])
        deadline = time.monotonic() + 30
        while len(_daemons_of(f"^sleep {token}")) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(_daemons_of(f"^sleep {token}")) == 3  # both of the daemon's and ours
        assert executor.stop([daemon]) == ["node @ localhost"]
        assert _daemons_of(f"^sleep {token}") == [str(bystander.pid)]
    finally:
        bystander.kill()
        bystander.wait()
        for pid in _daemons_of(str(token)):
            os.kill(int(pid), signal.SIGKILL)


@pytest.mark.timeout(120)
def test_daemons_are_stopped_all_at_once(tmp_path: Path) -> None:
    """Every daemon gets its SIGTERM before any has exited (one at a time, a teardown took
    the sum of the nodes' shutdowns); the report names them last started first."""
    token = random.randrange(10**6, 10**7)
    trace = tmp_path / "trace"
    job = config_from_dict(
        {
            "logging": {"run_dir": str(tmp_path / "run"), "wandb_mode": "disabled"},
            "cluster": {"executor": "local", "remote_shell": ["bash", "-c"]},
        }
    )

    def slow_to_stop(name: str) -> Step:  # takes a second to exit on SIGTERM
        body = (
            f"trap 'echo term >> {trace}; sleep 1; echo exit >> {trace}; exit 0' TERM; "
            f"while true; do sleep 0.1; done; : {token}"
        )
        return Step(name, "localhost", "bash -c " + shlex.quote(body), "background")

    daemons = [slow_to_stop(f"node {index}") for index in range(3)]
    lines: list[str] = []
    executor = Executor(job, report=lines.append)
    try:
        executor.run([*daemons, Step("job", "localhost", "true")])
        assert executor.stop(daemons) == [
            "node 2 @ localhost",
            "node 1 @ localhost",
            "node 0 @ localhost",
        ]
        assert trace.read_text().split() == ["term"] * 3 + ["exit"] * 3
    finally:
        for pid in _daemons_of(str(token)):
            os.kill(int(pid), signal.SIGKILL)


@pytest.mark.timeout(120)
def test_a_daemon_the_job_goes_on_without_is_reported_once_and_the_step_goes_on(
    tmp_path: Path,
) -> None:
    """A sandbox host (Step.needed False) that ends while a later step runs: the launch
    says so once, with its log, and the step runs to its end."""
    token = random.randrange(10**6, 10**7)
    job = config_from_dict(
        {
            "logging": {"run_dir": str(tmp_path / "run"), "wandb_mode": "disabled"},
            "cluster": {"executor": "local", "remote_shell": ["bash", "-c"]},
        }
    )
    lines: list[str] = []
    executor = Executor(job, report=lines.append, watch_s=1.0)
    host = Step("sandbox host 0", "localhost", f"sleep 2.{token}", "background", needed=False)
    steps = [host, Step("train", "localhost", "sleep 6")]
    try:
        executor.run(steps, until_done=True)
    finally:
        for pid in _daemons_of(str(token)):
            os.kill(int(pid), signal.SIGKILL)
    ended = [line for line in lines if "'sandbox host 0' on localhost ended" in line]
    assert len(ended) == 1 and "the job goes on without it" in ended[0], lines
    outcome = Outcome(steps)  # the rehearsal's report reads these lines: that host down
    for line in lines:
        outcome.read(line)
    assert list(outcome.lost) == ["sandbox host 0"] and outcome.restarted == {}
    assert "sandbox-host-0.log" in ended[0]
    assert lines.index(ended[0]) < lines.index("the job ended: stopping its daemons")


@pytest.mark.timeout(120)
def test_a_daemon_that_ends_before_the_job_is_started_again_with_the_reason(
    tmp_path: Path,
) -> None:
    """A Ray worker whose `ray start` times out during start-up (transient on a loaded
    node): with Step.restarts it is started again, the end of its log reported and kept,
    and the launch goes on; without restarts (or once they are spent, or while the job
    itself runs) its end fails the launch as before."""
    token = random.randrange(10**6, 10**7)
    tries = tmp_path / "tries"
    joined = tmp_path / "joined"
    flaky = "bash -c " + shlex.quote(
        f"echo x >> {tries}; if [ $(wc -l < {tries}) -lt 2 ]; then "
        f"echo 'ray start: timed out waiting for the GCS'; exit 1; fi; "
        f"touch {joined}; exec sleep 300.{token}"
    )
    wait_joined = f"for i in $(seq 300); do [ -f {joined} ] && exit 0; sleep 0.1; done; exit 1"
    job = config_from_dict(
        {
            "logging": {"run_dir": str(tmp_path / "run"), "wandb_mode": "disabled"},
            "cluster": {"executor": "local", "remote_shell": ["bash", "-c"]},
        }
    )
    lines: list[str] = []
    executor = Executor(job, report=lines.append, watch_s=0.5)
    try:
        worker = Step("ray worker 1", "localhost", flaky, "background", restarts=1)
        steps = [worker, Step("wait", "localhost", wait_joined), Step("job", "localhost", "true")]
        executor.run(steps)
        again = [line for line in lines if "ended before the job started" in line]
        assert len(again) == 1 and "timed out waiting for the GCS" in again[0], lines
        assert "starting it again (1 of 1" in again[0]
        outcome = Outcome(steps)  # the rehearsal's report: up, after one start again
        for line in lines:
            outcome.read(line)
        assert outcome.lost == {}
        assert outcome.restarted == {"ray worker 1": ["ray start: timed out waiting for the GCS"]}
        first_log = tmp_path / "run/logs/ray-worker-1.log.1"
        assert "timed out" in first_log.read_text()
        assert len(_daemons_of(f"sleep 300.{token}")) == 1
        executor.stop([worker])

        # the control: no restart, the same start-up failure stops the launch
        tries.unlink()
        joined.unlink()
        plain = Step("ray worker 1", "localhost", flaky, "background")
        with pytest.raises(LaunchError, match="'ray worker 1' on localhost ended"):
            Executor(job, report=lines.append, watch_s=0.5).run(
                [plain, Step("wait", "localhost", wait_joined), Step("job", "localhost", "true")]
            )
        # nor is a daemon started again once the job runs
        ending = Step("ray worker 2", "localhost", f"sleep 1.{token}", "background", restarts=2)
        with pytest.raises(LaunchError, match="'ray worker 2' on localhost ended"):
            Executor(job, report=lines.append, watch_s=0.5).run(
                [ending, Step("job", "localhost", f"sleep 20.{token}")]
            )
    finally:
        for pid in _daemons_of(str(token)):
            os.kill(int(pid), signal.SIGKILL)


def test_sandbox_hosts_are_daemons_the_job_outlives_in_both_renderers() -> None:
    job = load_config(ROOT / "launch/configs/swe-opd-cluster.yaml")
    steps = build_plan(job, hosts_from_config(job))
    hosts = [s for s in steps if s.name.startswith("sandbox host")]
    pruner = [s for s in steps if s.name == "prune checkpoints"]
    assert len(hosts) == 2 and not any(s.needed for s in hosts + pruner)
    assert all(s.needed for s in steps if s.kind == "background" and s not in hosts + pruner)
    script = render_sbatch(job, Path("/tmp/x.sbatch"))
    for index in range(2):
        assert re.search(rf"^beside sandbox-host-{index} ", script, flags=re.M), script
    assert re.search(r"^beside prune-checkpoints ", script, flags=re.M), script


@pytest.mark.timeout(120)
def test_a_daemon_that_ends_mid_step_fails_the_launch_at_once_and_the_jobs_end_stops_the_rest(
    tmp_path: Path,
) -> None:
    """A daemon the job needs that ends while a later step runs fails that step within the
    watch interval (not at the step's end) and the teardown stops the others; a background
    step that ends by itself (the snapshot sync) is no failure; when the followed job
    ends, its daemons are stopped."""
    token = random.randrange(10**6, 10**7)
    lasting, dying = f"sleep 300.{token}", f"sleep 3.{token}"
    job = config_from_dict(
        {
            "logging": {"run_dir": str(tmp_path / "run"), "wandb_mode": "disabled"},
            "cluster": {"executor": "local", "remote_shell": ["bash", "-c"]},
        }
    )
    lines: list[str] = []
    executor = Executor(job, report=lines.append, watch_s=1.0)
    other = Step("other", "localhost", lasting, "background")
    sync = Step("sync", "localhost", "true", "background", ends_itself=True)
    needed = Step("needed", "localhost", dying, "background")
    try:
        started = time.monotonic()
        with pytest.raises(LaunchError) as caught:
            executor.run([other, sync, needed, Step("train", "localhost", f"sleep 60.{token}")])
        assert time.monotonic() - started < 40
        message = str(caught.value)
        assert "'train' on localhost failed: the daemon 'needed' on localhost ended" in message
        assert "daemons it had started were stopped" in message
        assert _daemons_of(lasting) == [] and _daemons_of(f"sleep 60.{token}") == []
        executor.run([other, Step("train", "localhost", "sleep 2")], until_done=True)
        assert _daemons_of(lasting) == [] and lines[-1].endswith("stopped other @ localhost")
    finally:
        for pid in _daemons_of(str(token)):
            os.kill(int(pid), signal.SIGKILL)
