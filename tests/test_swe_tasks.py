"""The mini-SWE task family: deterministic generation, distinct bug families, hidden tests
kept out of the repository, and the repository committed with git inside a sandbox."""

from __future__ import annotations

import asyncio

import pytest

from rollout.rewards.swe import swebench_test_spec
from rollout.tasks.mini_swe import (
    UnknownFamilyError,
    family_names,
    generate_tasks,
    materialize,
    spec_of,
    swebench_instance,
)
from sandbox import LocalSandbox

FAMILIES = family_names()


def test_generation_is_deterministic_by_seed() -> None:
    assert generate_tasks(12, seed=7) == generate_tasks(12, seed=7)
    other = generate_tasks(12, seed=8)
    assert all(a.prompt != b.prompt for a, b in zip(generate_tasks(12, 7), other, strict=True))


def test_families_take_turns_and_there_are_at_least_four() -> None:
    assert len(FAMILIES) >= 4
    tasks = generate_tasks(2 * len(FAMILIES), seed=0)
    assert [spec_of(t).family for t in tasks] == FAMILIES * 2
    assert len({t.task_id for t in tasks}) == len(tasks)
    assert all(t.kind == "mini_swe" for t in tasks)


def test_tasks_of_one_family_vary_in_names_and_values() -> None:
    for family in FAMILIES:
        tasks = generate_tasks(6, seed=1, families=[family])
        assert len({t.prompt for t in tasks}) == 6
        modules = {spec_of(t).reference_patch.splitlines()[0] for t in tasks}
        assert len(modules) > 1, f"{family}: every task patches the same file"


def test_hidden_tests_are_not_in_the_repository() -> None:
    for task in generate_tasks(len(FAMILIES), seed=2):
        spec = spec_of(task)
        assert not set(spec.hidden_tests) & set(spec.files)
        hidden_text = "".join(spec.hidden_tests.values())
        assert all(hidden_text not in text for text in spec.files.values())
        for test_id in spec.fail_to_pass:
            path, name = test_id.split("::")
            assert path in spec.hidden_tests and f"def {name}(" in spec.hidden_tests[path]
        for test_id in spec.pass_to_pass:
            path, name = test_id.split("::")
            assert f"def {name}(" in {**spec.files, **spec.hidden_tests}[path]


def test_unknown_family_is_refused() -> None:
    with pytest.raises(UnknownFamilyError, match="unknown mini-SWE families"):
        generate_tasks(1, seed=0, families=["typo"])


def test_task_is_a_swebench_instance_graded_by_the_pytest_parser() -> None:
    task = generate_tasks(1, seed=3)[0]
    spec, instance = spec_of(task), swebench_instance(task)
    test_spec = swebench_test_spec(instance)
    assert test_spec.log_parser == "parse_log_pytest"
    assert spec.fail_to_pass == test_spec.FAIL_TO_PASS
    assert spec.pass_to_pass == test_spec.PASS_TO_PASS
    hidden_path = next(iter(spec.hidden_tests))
    assert f"+++ b/{hidden_path}" in instance["test_patch"]
    script = test_spec.eval_script
    assert script.index("git apply -v -") < script.index(">>>>> Start Test Output")
    assert "SWEBENCH_TEST_EXIT_CODE=$?" in script


@pytest.mark.timeout(30)
def test_materialize_commits_the_repository_without_hidden_tests() -> None:
    task = generate_tasks(1, seed=4)[0]
    spec = spec_of(task)

    async def run() -> tuple[str, str]:
        async with LocalSandbox() as sandbox:
            base = await materialize(task, sandbox)
            listing = await sandbox.exec(
                "git status --porcelain && git ls-files && git rev-list --count HEAD",
                10,
                cwd=spec.repo_dir,
            )
            assert listing.ok, listing.stderr
            return base, listing.stdout

    (base, listing), (base_again, _) = asyncio.run(run()), asyncio.run(run())
    assert sorted(listing.split()[:-1]) == sorted(spec.files)  # clean tree, every file tracked
    assert listing.split()[-1] == "1"
    assert not any(path in listing for path in spec.hidden_tests)
    assert base == base_again and len(base) == 40  # the base commit is a function of the task
