from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from launch.cli import app
from slime_ext.job.config import (
    ConfigError,
    JobConfig,
    apply_overrides,
    config_from_dict,
    config_to_yaml,
    load_config,
)

EXAMPLES = sorted(
    Path(str(p)) for p in resources.files("launch.configs").iterdir() if p.name.endswith(".yaml")
)
runner = CliRunner()
ROOT_CONFIGS = Path(__file__).resolve().parent.parent / "launch/configs"


def _write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_defaults_are_a_local_opd_job() -> None:
    config = JobConfig()
    assert config.algorithm.recipe == "opd"
    assert config.teacher.kind == "embedded"
    assert config.sandbox.backend == "auto" and config.sandbox.hosts == "auto"
    assert config.parallel.gpus_per_node == 0
    assert config.rollout.top_p == 1.0 and config.rollout.top_k == -1  # OPD samples untruncated


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_config_is_valid(path: Path) -> None:
    load_config(path)


def test_examples_exist() -> None:
    assert {p.name for p in EXAMPLES} >= {"demo.yaml", "swe-opd-cluster.yaml"}


def test_reference_cluster_layout_derives_dp4() -> None:
    config = load_config(next(p for p in EXAMPLES if p.name == "swe-opd-cluster.yaml"))
    assert (config.parallel.world_size, config.parallel.data_parallel) == (16, 4)
    assert config.rollout.max_context_tokens == 65_536


def test_yaml_round_trip_of_full_config() -> None:
    config = JobConfig()
    assert config_from_dict(yaml.safe_load(config_to_yaml(config))) == config


def test_unknown_key_is_named_with_suggestion_and_allowed_keys(tmp_path: Path) -> None:
    path = _write(tmp_path, {"rollout": {"max_turnz": 4}})
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert "rollout.max_turnz: unknown key; did you mean 'max_turns'?" in message
    assert "allowed: harness, think_policy," in message


def test_unknown_section_lists_the_sections(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="modle: unknown key; did you mean 'model'"):
        load_config(_write(tmp_path, {"modle": {}}))


def test_bad_choice_says_what_is_allowed(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError,
        match=r"rollout.think_policy: Input should be 'drop' or 'keep' "
        r"\(got 'sometimes'\)",
    ):
        load_config(_write(tmp_path, {"rollout": {"think_policy": "sometimes"}}))


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(_write(tmp_path, {"rollout": {"max_turns": 0, "temperature": -1}}))
    assert "2 problem(s)" in str(caught.value)
    assert "rollout.max_turns" in str(caught.value)
    assert "rollout.temperature" in str(caught.value)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"parallel": {"gpus_per_node": 4, "tp": 3}}, "does not divide num_nodes"),
        ({"parallel": {"tp": 2}}, "needs GPUs"),
        ({"teacher": {"kind": "remote"}}, "kind 'remote' needs url"),
        ({"teacher": {"model": None}}, "kind 'embedded' needs model"),
        ({"algorithm": {"recipe": "opsd"}}, "set teacher.kind: self"),
        ({"teacher": {"kind": "self"}}, "recipe 'opd' needs a separate teacher"),
        ({"rollout": {"max_new_tokens": 4096, "max_context_tokens": 4096}}, "must be smaller than"),
        ({"algorithm": {"recipe": "ppo"}}, "algorithm.recipe"),
        (
            {"algorithm": {"recipe": "rl", "reward_weight": 1.0}},
            "reward_weight adds an outcome reward to a teacher's KL",
        ),
        (
            {"algorithm": {"kl_discount": 0.9, "opd_loss": "topk_tail"}, "teacher": {"top_k": 8}},
            r"kl_discount 0.9 discounts the sampled reverse KL's advantage .* opd_loss: sampled",
        ),
        ({"algorithm": {"recipe": "sft", "kl_discount": 0.9}}, "recipe 'sft' with opd_loss"),
        ({"algorithm": {"kl_discount": 1.0}}, "kl_discount"),
        (
            {"parallel": {"num_nodes": 4, "gpus_per_node": 4, "tp": 2, "cp": 2, "dp": 2}},
            r"tp x cp x dp x pp = 2 x 2 x 2 x 1 = 8 GPUs, .* = 16: set dp to 4",
        ),
        (
            {"parallel": {"num_nodes": 1, "gpus_per_node": 4, "ep": 3}},
            r"ep x etp = 3 x 1 = 3 must divide tp x cp x dp = 4",
        ),
        (
            {"parallel": {"gpus_per_node": 4, "ep": 4, "num_experts": 6}},
            "num_experts 6 is not divisible by ep 4",
        ),
        (
            {
                "parallel": {
                    "num_nodes": 4,
                    "gpus_per_node": 4,
                    "tp": 2,
                    "cp": 2,
                    "max_tokens_per_gpu": 38_911,
                },
                "rollout": {"max_context_tokens": 65_536, "max_new_tokens": 12_288},
            },
            r"\(65536 \+ 12288\) / 2: set it to at least 38912",
        ),
    ],
)
def test_inconsistent_settings_are_explained(tmp_path: Path, data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(_write(tmp_path, data))


def test_reference_token_budget_is_exactly_enough(tmp_path: Path) -> None:
    config = load_config(next(p for p in EXAMPLES if p.name == "swe-opd-cluster.yaml"))
    assert config.parallel.max_tokens_per_gpu * config.parallel.cp == 65_536 + 12_288


def test_a_remote_teacher_started_on_a_node_is_reached_there_unless_a_url_is_given() -> None:
    teacher = {"kind": "remote", "model": "/m", "node": "gpu-9", "port": 8123}
    assert config_from_dict({"teacher": teacher}).teacher.url == "http://gpu-9:8123"
    given = {**teacher, "url": "http://lb:80"}
    assert config_from_dict({"teacher": given}).teacher.url == "http://lb:80"
    round_trip = config_from_dict({"teacher": teacher})
    assert config_from_dict(round_trip.model_dump(mode="json")) == round_trip


def test_moe_layout_validates(tmp_path: Path) -> None:
    data = {"parallel": {"num_nodes": 2, "gpus_per_node": 8, "tp": 2, "ep": 8, "num_experts": 256}}
    config = load_config(_write(tmp_path, data))
    assert config.parallel.data_parallel == 8


def test_self_teacher_recipes_validate(tmp_path: Path) -> None:
    config = load_config(
        _write(tmp_path, {"algorithm": {"recipe": "oprd"}, "teacher": {"kind": "self"}})
    )
    assert config.teacher.kind == "self"


def test_overrides_parse_values_as_yaml(tmp_path: Path) -> None:
    path = _write(tmp_path, {"rollout": {"max_turns": 4}})
    config = load_config(
        path,
        [
            "rollout.max_turns=9",
            "algorithm.lr=3e-5",
            "logging.wandb_mode=disabled",
            "parallel.gpus_per_node=8",
        ],
    )
    assert config.rollout.max_turns == 9
    assert config.algorithm.lr == pytest.approx(3e-5)
    assert config.logging.wandb_mode == "disabled"
    assert config.parallel.data_parallel == 8


def test_overrides_do_not_mutate_input() -> None:
    data = {"rollout": {"max_turns": 4}}
    apply_overrides(data, ["rollout.max_turns=5"])
    assert data == {"rollout": {"max_turns": 4}}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.max_turns", "expected section.key=value"),
        ("rollout.max_turns.deep=1", "max_turns is a value, not a section"),
    ],
)
def test_bad_override_is_explained(tmp_path: Path, override: str, message: str) -> None:
    path = _write(tmp_path, {"rollout": {"max_turns": 4}})
    with pytest.raises(ConfigError, match=message):
        load_config(path, [override])


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "absent.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("rollout: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML") as caught:
        load_config(broken)
    assert str(caught.value).startswith(f"{broken}:2:1: not valid YAML: expected ','")
    assert "<unicode string>" not in str(caught.value)
    tabbed = tmp_path / "tabbed.yaml"
    tabbed.write_text("rollout:\n\tmax_turns: 3\n")
    with pytest.raises(ConfigError, match=f"^{tabbed}:2:1: .*spaces, not tabs$"):
        load_config(tabbed)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(binary)
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(listed)


def test_empty_file_is_the_default(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(path) == JobConfig()


def test_cli_validate_ok_and_failure(tmp_path: Path) -> None:
    good = runner.invoke(app, ["config", "validate", str(EXAMPLES[0])])
    assert good.exit_code == 0, good.output
    assert "ok" in good.output
    bad = runner.invoke(app, ["config", "validate", str(_write(tmp_path, {"rollout": {"x": 1}}))])
    assert bad.exit_code == 2
    assert "rollout.x: unknown key" in bad.output


def test_cli_validate_applies_set(tmp_path: Path) -> None:
    path = _write(tmp_path, {})
    result = runner.invoke(app, ["config", "validate", str(path), "--set", "parallel.tp=2"])
    assert result.exit_code == 2
    assert "needs GPUs" in result.output


def test_cli_show_prints_full_default() -> None:
    result = runner.invoke(app, ["config", "show"])
    assert result.exit_code == 0
    assert config_from_dict(yaml.safe_load(result.output)) == JobConfig()


def test_cli_show_explain_puts_every_documented_key_under_its_docstring() -> None:
    """--explain: each key under its explanation (the setting's docstring, the same text
    the code reads), still YAML that loads to the same config."""
    example = Path(__file__).resolve().parents[1] / "launch/configs/swe-opd-cluster.yaml"
    result = runner.invoke(app, ["config", "show", str(example), "--explain"])
    assert result.exit_code == 0, result.output
    assert config_from_dict(yaml.safe_load(result.output)) == load_config(example)
    lines = result.output.splitlines()
    at = lines.index("  tasks_file: /shared/data/swe-train.jsonl")
    comment = " ".join(line.strip().removeprefix("# ") for line in lines[at - 3 : at])
    assert "Training tasks as JSONL rows" in comment
    documented = [
        (section, key)
        for section, info in JobConfig.model_fields.items()
        for key, field in info.annotation.model_fields.items()  # type: ignore[union-attr]
        if field.description
    ]
    assert len(documented) > 100  # the docstrings are read, not lost
    for section, key in documented[:: len(documented) // 20]:
        index = next(i for i, line in enumerate(lines) if line.startswith(f"  {key}:"))
        assert lines[index - 1].startswith("  # "), (section, key)


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["config"],
        ["factory"],
        ["demo", "--help"],
        ["config", "validate", "--help"],
        ["factory", "build", "--help"],
    ],
)
def test_help_everywhere(args: list[str]) -> None:
    result = runner.invoke(app, [*args, "--help"] if "--help" not in args else args)
    assert result.exit_code == 0
    assert "Usage" in result.output


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_validate_checks_each_example_for_the_command_it_is_for(path: Path) -> None:
    """gpus_per_node > 0: a cluster job, checked as `opd launch` checks it; 0: the local
    trainer's job, checked as `opd train` does."""
    result = runner.invoke(app, ["config", "validate", str(path)])
    assert result.exit_code == 0, result.output
    command = "opd launch" if load_config(path).parallel.gpus_per_node else "opd train"
    assert result.output.startswith(f"ok for {command}: {path}: recipe ")


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ({"algorithm": {"recipe": "ssd"}}, "algorithm.recipe 'ssd': the local trainer runs"),
        ({"model": {"student": "bundled:coach"}}, "model.student 'bundled:coach': bundled"),
        ({"teacher": {"model": "bundled:tutor"}}, "teacher.model 'bundled:tutor': bundled"),
    ],
)
def test_validate_refuses_what_opd_train_refuses_with_the_same_problem(
    tmp_path: Path, data: dict, problem: str
) -> None:
    """A local config (gpus_per_node 0) that `opd train` would refuse before building
    anything: validate refuses it too, through the same check, with the same text. (Before,
    validate only parsed: `opd config validate` said ok to a SWE job for the local trainer.)"""
    path = _write(tmp_path, {**data, "logging": {"run_dir": str(tmp_path / "run")}})
    validate = runner.invoke(app, ["config", "validate", str(path)])
    train = runner.invoke(app, ["train", str(path)])
    assert (validate.exit_code, train.exit_code) == (2, 2), validate.output + train.output
    assert validate.output.startswith(f"not ready for opd train: {path}\n")
    assert train.output.startswith(f"cannot train: {path}\n")
    problems = validate.output.split("\n", 1)[1]
    assert problems == train.output.split("\n", 1)[1]
    assert problem in problems
    assert not (tmp_path / "run").exists()  # refused before the run directory is made


def test_a_config_extends_a_base_key_by_key(tmp_path: Path) -> None:
    (tmp_path / "bases").mkdir()
    (tmp_path / "bases/root.yaml").write_text(
        "rollout: {max_turns: 7, temperature: 0.5}\n"
        "cluster: {sandbox_hosts: [a, b], env: {X: '1', Y: '2'}}\n"
        "logging: {wandb_project: root}\n"
    )
    (tmp_path / "bases/mid.yaml").write_text(
        "extends: root.yaml\nrollout: {max_turns: 9}\ncluster: {env: {Y: '3'}}\n"
    )
    top = tmp_path / "top.yaml"
    top.write_text(
        "extends: bases/mid.yaml\ncluster: {sandbox_hosts: [c]}\nteacher: {api_key_env: null}\n"
    )
    job = load_config(top, ["logging.wandb_project=top"])
    assert (job.rollout.max_turns, job.rollout.temperature) == (9, 0.5)  # key by key
    assert job.cluster.sandbox_hosts == ["c"]  # a list replaces the base's
    assert job.cluster.env == {"X": "1", "Y": "3"}
    assert job.teacher.api_key_env is None and job.logging.wandb_project == "top"


@pytest.mark.parametrize(
    ("files", "problem"),
    [
        ({"top.yaml": "extends: nope.yaml\n"}, r"nope.yaml: no such config file \(extended by"),
        ({"top.yaml": "extends: [a.yaml]\n"}, "extends: the path of the config"),
        (
            {"top.yaml": "extends: a.yaml\n", "a.yaml": "extends: top.yaml\n"},
            r"extends makes a loop: .*top.yaml -> .*a.yaml -> .*top.yaml",
        ),
        ({"top.yaml": "extends: a.yaml\n", "a.yaml": "rollout: {max_turns: 0}\n"}, "max_turns"),
    ],
)
def test_a_bad_extends_is_explained(tmp_path: Path, files: dict[str, str], problem: str) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=problem):
        load_config(tmp_path / "top.yaml")


def test_the_self_distillation_examples_write_only_what_differs_from_the_opd_run() -> None:
    base = yaml.safe_load((ROOT_CONFIGS / "swe-opd-cluster.yaml").read_text())
    for name in ("swe-opsd-35b-a3b.yaml", "swe-oprd-35b-a3b.yaml"):
        data = yaml.safe_load((ROOT_CONFIGS / name).read_text())
        assert data.pop("extends") == "swe-opd-cluster.yaml"
        for section, values in data.items():
            for key, value in values.items():
                assert base.get(section, {}).get(key, object()) != value, (name, section, key)
        job = load_config(ROOT_CONFIGS / name)
        assert job.teacher.model == job.model.student == "/models/Qwen3.5-35B-A3B"
        assert job.parallel.tp * job.parallel.cp * job.parallel.dp == 16


def test_sandboxes_that_could_outgrow_this_machine_are_a_warning_naming_the_fix() -> None:
    """The local trainer's SWE sandboxes run here: their memory caps times how many run
    at once against this machine's memory, said (a cap is not a reservation), with the
    concurrency that fits; none for TIR or for E2B's sandboxes, which run elsewhere."""
    from slime_ext.local.preflight import local_job_warnings, sandbox_memory_problem

    swe = {"rollout": {"harness": "swe", "concurrency": 8}, "sandbox": {"memory_mb": 2048}}
    job = config_from_dict(swe)
    assert sandbox_memory_problem(job, 16384) is None  # 8 x 2 GB fit 16 GB
    problem = sandbox_memory_problem(job, 8192)
    assert problem is not None and "= 16384 MB, more than this machine's 8192 MB" in problem
    assert "set rollout.concurrency to at most 4" in problem
    capped = config_from_dict({**swe, "sandbox": {"memory_mb": 2048, "max_sandboxes": 2}})
    assert sandbox_memory_problem(capped, 8192) is None  # 2 at once, whatever the concurrency
    e2b = config_from_dict({**swe, "sandbox": {"memory_mb": 2048, "backend": "e2b"}})
    assert sandbox_memory_problem(e2b, 1024) is None
    assert sandbox_memory_problem(config_from_dict({}), 1) is None  # TIR: no sandboxes
    huge = {
        "rollout": {"harness": "swe", "concurrency": 64},
        "sandbox": {"max_sandboxes": 64, "memory_mb": 2**20},
    }
    assert local_job_warnings(config_from_dict(huge))  # 64 TB: more than any machine here
    path = Path(__file__).resolve().parents[1] / "launch/configs/swe-local.yaml"
    sets = [
        "--set",
        "rollout.concurrency=64",
        "--set",
        "sandbox.max_sandboxes=64",
        "--set",
        f"sandbox.memory_mb={2**20}",
    ]
    result = runner.invoke(app, ["config", "validate", str(path), *sets])
    assert result.exit_code == 0 and "warning: sandbox.memory_mb 1048576 x 64" in result.output
