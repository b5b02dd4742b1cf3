"""The cluster's sequence layout, resolved by the plan (slime_ext/job/sequence_layout.py): packed
for a full-attention or Gated DeltaNet hybrid student (its config.json, or a Qwen3.5 /
Qwen3-Next name), per turn for a recurrent one and for a student the plan cannot see, and
the flags that make slime and Megatron take it."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from launch.plan import build_plan, hosts_from_config
from slime_ext.job.config import ConfigError, config_from_dict
from slime_ext.job.sequence_layout import resolve
from slime_ext.models.factory import build_checkpoint

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "launch/configs/swe-opd-cluster.yaml"
TREE_FLAGS = [
    "--spec", "slime_ext.slime.tree_attention", "layer_spec",
    "--position-embedding-type", "none",
]  # fmt: skip


def _job(student: str, script: str = "scripts/models/qwen3-8B.sh", **algorithm: Any) -> Any:
    base: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    base["model"]["student"] = student
    base["cluster"]["model_args_script"] = script
    # the tiny stand-ins of a real student have 8192 positions: a budget that fits them
    base["rollout"].update({"max_context_tokens": 6144, "max_new_tokens": 2048})
    base.setdefault("algorithm", {}).update(algorithm)
    return config_from_dict(base)


def _submitted(job: Any) -> tuple[list[str], str, dict[str, Any]]:
    """The submit command's words, its note, and the job config the hooks will read."""
    steps = build_plan(job, hosts_from_config(job))
    [submit] = [s for s in steps if s.name == "submit"]
    [written] = [s for s in steps if s.name == "write job config"]
    return shlex.split(submit.command), submit.note, yaml.safe_load(written.content)


@pytest.fixture(scope="module")
def full_attention(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("qwen3-tiny", tmp_path_factory.mktemp("qwen3") / "student")


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("qwen3_5-tiny", tmp_path_factory.mktemp("qwen3_5") / "student")


def _has(words: list[str], flags: list[str]) -> bool:
    return any(words[i : i + len(flags)] == flags for i in range(len(words)))


def test_a_full_attention_student_is_packed_and_slime_gets_the_tree_attention(
    full_attention: Path,
) -> None:
    words, note, job_yaml = _submitted(_job(str(full_attention)))
    assert _has(words, TREE_FLAGS)
    assert _has(words, ["--custom-megatron-init-path", "slime_ext.slime.tree.init"])
    assert job_yaml["algorithm"]["sequence_layout"] == "packed"  # what the hooks read
    assert "sequence layout packed: auto: the student is full-attention" in note


def test_a_gated_delta_hybrid_is_packed_and_slime_gets_the_tree_layers(hybrid: Path) -> None:
    """Its linear-attention layers are slime's, wrapped by the same spec
    (tree_attention.layer_spec reads --hf-checkpoint: tests/test_megatron_hybrid.py)."""
    words, note, job_yaml = _submitted(_job(str(hybrid)))
    assert _has(words, TREE_FLAGS)
    assert job_yaml["algorithm"]["sequence_layout"] == "packed"
    assert "Gated DeltaNet hybrid (its config.json)" in note
    per_turn = resolve(_job(str(hybrid), sequence_layout="per_turn"))  # the example: CP 2
    assert per_turn.layout == "per_turn" and "under CP slime's own Gated DeltaNet" in per_turn.why


@pytest.mark.parametrize(
    ("student", "script"),
    [
        ("/models/Qwen3.5-9B", "scripts/models/qwen3.5-9B.sh"),
        ("/models/student", "scripts/models/qwen3-next-80B-A3B.sh"),
    ],
)
def test_a_gated_delta_family_is_known_by_name_where_its_config_is_not_readable(
    student: str, script: str
) -> None:
    resolved = resolve(_job(student, script))
    assert resolved.layout == "packed" and "(its name)" in resolved.why


@pytest.mark.parametrize("student", ["/models/Falcon-H1-7B", "/models/mamba2-2.7b"])
def test_a_recurrent_family_stays_per_turn_and_refuses_packed(student: str) -> None:
    resolved = resolve(_job(student))
    assert resolved.layout == "per_turn" and "recurrent" in resolved.why
    with pytest.raises(ConfigError, match=r"recurrent.*use per_turn"):
        resolve(_job(student, sequence_layout="packed"))


def test_an_unseen_student_is_per_turn_unless_packing_is_asked_for() -> None:
    resolved = resolve(_job("/models/Qwen3-8B"))
    assert resolved.layout == "per_turn" and "not readable" in resolved.why
    words, _, _ = _submitted(_job("/models/Qwen3-8B", sequence_layout="packed"))
    assert _has(words, TREE_FLAGS)
    assert resolve(_job("/models/Qwen3-8B", sequence_layout="per_turn")).layout == "per_turn"


def test_pretokenized_recipes_are_per_turn_and_refuse_packed(full_attention: Path) -> None:
    job = _job(str(full_attention), recipe="sft")
    assert resolve(job).layout == "per_turn"
    with pytest.raises(ConfigError, match="pre-tokenized"):
        resolve(_job(str(full_attention), recipe="sft", sequence_layout="packed"))


@pytest.mark.parametrize(
    "extra",
    [
        ["--spec", "my.spec"],
        ["--position-embedding-type", "rope"],
        ["--custom-megatron-init-path", "my.init"],
    ],
)
def test_flags_that_would_undo_packing_are_refused_only_when_packed(
    full_attention: Path, hybrid: Path, extra: list[str]
) -> None:
    from launch.plan import check_cluster

    packed = _job(str(full_attention))
    packed.cluster.extra_train_args = extra
    with pytest.raises(ConfigError, match=rf"{extra[0]}.*silently wrong objective"):
        check_cluster(packed)
    per_turn = _job(str(hybrid), sequence_layout="per_turn")
    per_turn.cluster.extra_train_args = extra
    check_cluster(per_turn)
