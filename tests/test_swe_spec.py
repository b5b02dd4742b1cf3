"""SWETaskSpec adapters over rows shaped like the published datasets (SWE-bench Verified,
a swebench 5 row, SWE-bench Pro, SWE-smith, SWE-Gym), and the Task round trip."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rollout.tasks.swe_spec import (
    DEFAULT_SWE_IMAGE,
    SWEBENCH_ENV_SETUP,
    SWETaskSpec,
    SWETaskSpecError,
    from_generic,
    from_swebench,
    from_swebench_pro,
    from_task,
    swebench_image,
    swebench_pro_tag,
    to_task,
)
from rollout.trajectory import Task

SWEBENCH_5_INSTANCE = Path(__file__).parent / "data" / "swe" / "django_instance.json"
"""A swebench 5 row (django__django-12983), its eval_script as swebench wrote it."""

# Shaped like princeton-nlp/SWE-bench_Verified (test split); patches shortened.
VERIFIED_ROW: dict[str, Any] = {
    "repo": "django/django",
    "instance_id": "django__django-11099",
    "base_commit": "d26b2424437dabeeca94d7900b37d2df4410da0c",
    "patch": (
        "diff --git a/django/contrib/auth/validators.py b/django/contrib/auth/validators.py\n"
        "--- a/django/contrib/auth/validators.py\n+++ b/django/contrib/auth/validators.py\n"
        "@@ -7,7 +7,7 @@\n-    regex = r'^[\\w.@+-]+$'\n+    regex = r'^[\\w.@+-]+\\Z'\n"
    ),
    "test_patch": (
        "diff --git a/tests/auth_tests/test_validators.py b/tests/auth_tests/test_validators.py\n"
        "--- a/tests/auth_tests/test_validators.py\n+++ b/tests/auth_tests/test_validators.py\n"
    ),
    "problem_statement": (
        "UsernameValidator allows trailing newline in usernames\n"
        "Description\n\nASCIIUsernameValidator and UnicodeUsernameValidator use the regex "
        "r'^[\\w.@+-]+$' ... which will also match a trailing newline."
    ),
    "hints_text": "",
    "created_at": "2019-03-20T03:46:18Z",
    "version": "3.0",
    "FAIL_TO_PASS": json.dumps(
        [
            "test_ascii_validator (auth_tests.test_validators.UsernameValidatorsTests)",
            "test_unicode_validator (auth_tests.test_validators.UsernameValidatorsTests)",
        ]
    ),
    "PASS_TO_PASS": json.dumps(
        ["test_help_text (auth_tests.test_validators.UserAttributeSimilarityValidatorTest)"]
    ),
    "environment_setup_commit": "419a78300f7cd27611196e1e464d50fd0385ff27",
}

# Shaped like ScaleAI/SWE-bench_Pro (test split): lists as Python literals, lower-case
# test keys, the harness's fields.
PRO_INSTANCE = (
    "instance_ansible__ansible-eea46a0d1b99a6dadedbb6a3502d599235fa7ec3"
    "-v390e508d27db7a51eece36bb6d9698b63a5b638a"
)
PRO_TESTS = "test/units/modules/network/eric_eccli"
PRO_ROW: dict[str, Any] = {
    "repo": "ansible/ansible",
    "instance_id": PRO_INSTANCE,
    "base_commit": "07e7b69c04116f598ed2376616cbb46343d9a0e9",
    "patch": "diff --git a/lib/ansible/plugins/cliconf/eric_eccli.py ...\n",
    "test_patch": f"diff --git a/{PRO_TESTS}/test_eccli_command.py ...\n",
    "problem_statement": "Add support for Ericsson ECCLI devices.",
    "requirements": "- A cliconf plugin named eric_eccli must exist.",
    "interface": "Type: Class\nName: Cliconf\nPath: lib/ansible/plugins/cliconf/eric_eccli.py",
    "repo_language": "python",
    "fail_to_pass": str(
        [
            f"{PRO_TESTS}/test_eccli_command.py::TestEricEccliModule::test_eric_eccli_command_simple",
            f"{PRO_TESTS}/test_eccli_command.py::TestEricEccliModule::test_eric_eccli_command_wait_for",
        ]
    ),
    "pass_to_pass": "[]",
    "issue_specificity": "['core_feat']",
    "issue_categories": "['networking_knowledge']",
    "before_repo_set_cmd": (
        "git reset --hard 07e7b69c04116f598ed2376616cbb46343d9a0e9\n"
        "git clean -fd \n"
        "git checkout 07e7b69c04116f598ed2376616cbb46343d9a0e9 \n"
        f"git checkout eea46a0d1b99a6dadedbb6a3502d599235fa7ec3 -- {PRO_TESTS}/__init__.py "
        f"{PRO_TESTS}/test_eccli_command.py"
    ),
    "selected_test_files_to_run": str(
        [f"{PRO_TESTS}/test_eccli_command.py", f"{PRO_TESTS}/__init__.py"]
    ),
    "dockerhub_tag": (
        "ansible.ansible-ansible__ansible-eea46a0d1b99a6dadedbb6a3502d599235fa7ec3"
        "-v390e508d27db7a51eece36bb6d9698b63a5b638a"
    ),
}

# Shaped like SWE-bench/SWE-smith: a synthetic bug in a mirror repo, its own image.
SMITH_ROW: dict[str, Any] = {
    "instance_id": "pandas-dev__pandas.95280573.func_pm_op_swap__0x1jxzh8",
    "repo": "swesmith/pandas-dev__pandas.95280573",
    "patch": "diff --git a/pandas/core/ops/array_ops.py b/pandas/core/ops/array_ops.py\n",
    "FAIL_TO_PASS": ["pandas/tests/arithmetic/test_numeric.py::test_operators_frame"],
    "PASS_TO_PASS": ["pandas/tests/arithmetic/test_numeric.py::test_df_mod_zero_df"],
    "created_at": "2025-03-14T20:12:41.090419",
    "image_name": "jyangballin/swesmith.x86_64.pandas-dev_1776_pandas.95280573",
    "problem_statement": "Subtracting a DataFrame from a scalar gives the negated result.",
    "test_command": "pytest -rA pandas/tests/arithmetic/test_numeric.py",
    "setup_commands": "git checkout pandas-dev__pandas.95280573.func_pm_op_swap__0x1jxzh8\n"
    "git checkout HEAD~1 -- pandas/tests\n",
}


@pytest.mark.parametrize(
    "instance_id",
    ["django__django-11099", "astropy__astropy-12907", "Project-MONAI__MONAI-4321"],
)
def test_swebench_image_names_follow_the_swebench_package(instance_id: str) -> None:
    from swebench.task.checks import expected_image

    assert swebench_image(instance_id) == expected_image(instance_id)


def test_swebench_verified_row() -> None:
    spec = from_swebench(VERIFIED_ROW)
    assert spec.image == "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    assert (spec.workdir, spec.kind, spec.grading) == ("/testbed", "swebench", "swebench")
    assert spec.fail_to_pass == json.loads(VERIFIED_ROW["FAIL_TO_PASS"])
    assert spec.pass_to_pass == json.loads(VERIFIED_ROW["PASS_TO_PASS"])
    assert spec.base_commit == VERIFIED_ROW["base_commit"]
    assert (
        spec.gold_patch == VERIFIED_ROW["patch"] and spec.test_patch == VERIFIED_ROW["test_patch"]
    )
    assert spec.setup_commands == [] and spec.eval_script is None
    assert (spec.version, spec.environment_setup_commit) == (
        "3.0",
        "419a78300f7cd27611196e1e464d50fd0385ff27",
    )
    assert spec.extra == {}


def test_swebench_5_row_keeps_its_image_eval_script_and_parser() -> None:
    row = {
        **VERIFIED_ROW,
        "image": "ghcr.io/epoch-research/swe-bench.eval.x86_64.django__django-11099",
        "eval_script": "#!/bin/bash\n: '>>>>> Start Test Output'\n./tests/runtests.py\n",
        "log_parser": "parse_log_django",
        "difficulty": "<15 min fix",
    }
    spec = from_swebench(row)
    assert spec.image == row["image"]
    assert spec.eval_script == row["eval_script"] and spec.log_parser == "parse_log_django"
    assert spec.extra == {"difficulty": "<15 min fix"}


def test_swebench_rows_enter_the_conda_testbed_env_as_swebench_eval_scripts_do() -> None:
    eval_script = json.loads(SWEBENCH_5_INSTANCE.read_text())["eval_script"]
    # The two lines after swebench's script header (#!/bin/bash, set -uxo pipefail).
    assert eval_script.splitlines()[2:4] == SWEBENCH_ENV_SETUP.splitlines()
    assert SWEBENCH_ENV_SETUP.splitlines() == [
        "source /opt/miniconda3/bin/activate",
        "conda activate testbed",
    ]
    assert from_swebench(VERIFIED_ROW).env_setup == SWEBENCH_ENV_SETUP


def test_swebench_pro_and_generic_rows_enter_only_the_environment_they_name() -> None:
    assert from_swebench_pro(PRO_ROW).env_setup is None  # the images' ENV lines hold it
    assert from_generic(SMITH_ROW).env_setup is None
    venv = "source /testbed/.venv/bin/activate"
    spec = from_generic({**SMITH_ROW, "env_setup": venv})
    assert spec.env_setup == venv and "env_setup" not in spec.extra
    assert from_generic({**SMITH_ROW, "env_setup": ""}).env_setup is None
    with pytest.raises(SWETaskSpecError, match="env_setup"):
        from_generic({**SMITH_ROW, "env_setup": ["conda activate testbed"]})


def test_swebench_mirror_namespace() -> None:
    spec = from_swebench(VERIFIED_ROW, namespace="registry.local/swebench")
    assert spec.image == "registry.local/swebench/sweb.eval.x86_64.django_1776_django-11099:latest"


def test_swebench_pro_row() -> None:
    spec = from_swebench_pro(PRO_ROW)
    assert spec.image == f"jefzda/sweap-images:{PRO_ROW['dockerhub_tag']}"
    assert (spec.workdir, spec.kind, spec.grading) == ("/app", "swebench_pro", "swebench_pro")
    assert spec.setup_commands == [
        "git reset --hard 07e7b69c04116f598ed2376616cbb46343d9a0e9",
        "git clean -fd",
        "git checkout 07e7b69c04116f598ed2376616cbb46343d9a0e9",
    ]
    # The tests of the fix commit arrive only at grading.
    assert len(spec.eval_setup_commands) == 1
    assert spec.eval_setup_commands[0].startswith("git checkout eea46a0d")
    assert spec.test_command == (
        f"bash /workspace/run_script.sh {PRO_TESTS}/test_eccli_command.py,{PRO_TESTS}/__init__.py"
    )
    assert spec.fail_to_pass == [
        f"{PRO_TESTS}/test_eccli_command.py::TestEricEccliModule::test_eric_eccli_command_simple",
        f"{PRO_TESTS}/test_eccli_command.py::TestEricEccliModule::test_eric_eccli_command_wait_for",
    ]
    assert spec.pass_to_pass == []
    assert spec.language == "python" and spec.requirements.startswith("- A cliconf")
    assert spec.extra == {
        "issue_specificity": "['core_feat']",
        "issue_categories": "['networking_knowledge']",
    }


@pytest.mark.parametrize(
    ("instance_id", "repo", "published_tag"),
    [
        (PRO_INSTANCE, "ansible/ansible", PRO_ROW["dockerhub_tag"]),
        (
            "instance_protonmail__webclients-f161c10cf7d31abf82e8d64d7a99c9fac5acfa18",
            "protonmail/webclients",
            "protonmail.webclients-protonmail__webclients-f161c10cf7d31abf82e8d64d7a99c9fac5acfa18",
        ),
    ],
)
def test_swebench_pro_tag_derivation_matches_published_tags(
    instance_id: str, repo: str, published_tag: str
) -> None:
    assert swebench_pro_tag(instance_id, repo) == published_tag


def test_swebench_pro_row_without_tag_gets_the_harness_tag_cut_to_128() -> None:
    row = {key: value for key, value in PRO_ROW.items() if key != "dockerhub_tag"}
    assert from_swebench_pro(row).image == f"jefzda/sweap-images:{PRO_ROW['dockerhub_tag']}"
    long_id = "instance_org__" + "x" * 200
    assert len(swebench_pro_tag(long_id, "Org/Repo")) == 128
    assert swebench_pro_tag(long_id, "Org/Repo").startswith("org.repo-org__x")


def test_swe_smith_row_through_the_generic_adapter() -> None:
    spec = from_generic(SMITH_ROW)
    assert spec.image == SMITH_ROW["image_name"]
    assert (spec.workdir, spec.kind, spec.grading) == ("/testbed", "generic_swe", "script")
    assert spec.test_command == SMITH_ROW["test_command"]
    assert spec.setup_commands == [
        "git checkout pandas-dev__pandas.95280573.func_pm_op_swap__0x1jxzh8",
        "git checkout HEAD~1 -- pandas/tests",
    ]
    assert spec.fail_to_pass == SMITH_ROW["FAIL_TO_PASS"] and spec.base_commit is None


def test_generic_row_defaults_and_grading_choice() -> None:
    gym_row = {
        **VERIFIED_ROW,
        "instance_id": "getmoto__moto-5752",
        "repo": "getmoto/moto",
        "eval_script": "#!/bin/bash\n: '>>>>> Start Test Output'\npytest -rA\n",
    }
    spec = from_generic(gym_row)
    assert spec.image == DEFAULT_SWE_IMAGE and spec.grading == "swebench"
    assert from_generic(gym_row, default_image="xingyaoww/sweb.eval.x86_64.x").image == (
        "xingyaoww/sweb.eval.x86_64.x"
    )
    no_tests = {k: v for k, v in SMITH_ROW.items() if k != "test_command"}
    with pytest.raises(SWETaskSpecError, match="test_command"):
        from_generic(no_tests)
    assert from_generic({**SMITH_ROW, "workdir": "/repo"}).workdir == "/repo"


@pytest.mark.parametrize(
    ("row", "adapter", "kind"),
    [
        (VERIFIED_ROW, from_swebench, "swebench"),
        (PRO_ROW, from_swebench_pro, "swebench_pro"),
        (SMITH_ROW, from_generic, "generic_swe"),
        ({**SMITH_ROW, "env_setup": "conda activate smith"}, from_generic, "generic_swe"),
    ],
)
def test_task_round_trip_through_json(row: dict[str, Any], adapter: Any, kind: str) -> None:
    spec = adapter(row)
    task = to_task(spec)
    assert (task.task_id, task.kind, task.answer) == (row["instance_id"], kind, None)
    reloaded = Task.model_validate_json(task.model_dump_json())
    assert from_task(reloaded) == spec


def test_task_prompt_carries_swebench_pro_requirements_and_interface() -> None:
    prompt = to_task(from_swebench_pro(PRO_ROW)).prompt
    assert prompt.startswith(PRO_ROW["problem_statement"])
    assert f"Requirements:\n{PRO_ROW['requirements']}" in prompt
    assert f"Interface:\n{PRO_ROW['interface']}" in prompt
    assert to_task(from_swebench(VERIFIED_ROW)).prompt == VERIFIED_ROW["problem_statement"].strip()


def test_from_task_refuses_other_kinds_and_mismatched_metadata() -> None:
    task = to_task(from_swebench(VERIFIED_ROW))
    with pytest.raises(SWETaskSpecError, match="mini_swe"):
        from_task(task.model_copy(update={"kind": "mini_swe"}))
    with pytest.raises(SWETaskSpecError, match="not this swebench_pro task"):
        from_task(task.model_copy(update={"kind": "swebench_pro"}))
    with pytest.raises(SWETaskSpecError, match="not a SWE task spec"):
        from_task(task.model_copy(update={"metadata": {"instance_id": "x"}}))


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"problem_statement": ""}, "problem_statement"),
        ({"FAIL_TO_PASS": "not a list"}, "FAIL_TO_PASS"),
        ({"PASS_TO_PASS": json.dumps({"a": 1})}, "PASS_TO_PASS"),
        ({"base_commit": None}, "base_commit"),
    ],
)
def test_malformed_rows_name_the_instance_and_field(change: dict[str, Any], fragment: str) -> None:
    with pytest.raises(SWETaskSpecError, match=fragment) as raised:
        from_swebench({**VERIFIED_ROW, **change})
    assert "django__django-11099" in str(raised.value)


def test_spec_refuses_unknown_fields_and_relative_workdirs() -> None:
    spec = from_swebench(VERIFIED_ROW)
    with pytest.raises(ValueError):
        SWETaskSpec.model_validate({**spec.model_dump(), "unknown": 1})
    with pytest.raises(ValueError):
        SWETaskSpec.model_validate({**spec.model_dump(), "workdir": "relative"})
