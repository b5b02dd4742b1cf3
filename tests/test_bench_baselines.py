"""bench/baselines.py's bookkeeping (no training here: the bench itself is outside CI):
tuning picks by validation, seeds pair up, accuracy at equal compute, the report from kept
results, and a kept result is reused rather than retrained."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import baselines
from baselines import Arm, Bench, Result, Scale, at_compute, save_result, t_interval
from baselines_report import write_report

SCALE = Scale(steps=4, eval_every=2, n_test=20, n_val=10, seeds=2)


def step_compute(tokens: float) -> dict[str, float]:
    return {
        "student_train": tokens,
        "student_sampled": 0.0,
        "teacher_computed": 0.0,
        "teacher_scored": 0.0,
        "reward": 0.25,
        "nonzero_advantage_frac": 0.5,
    }


def fake_result(arm: Arm, accuracy: float, tokens_per_step: float, steps: int = 4) -> Result:
    """A finished run whose test accuracy grows linearly to `accuracy` at --steps."""
    test = {s: accuracy * s / SCALE.steps for s in range(0, steps + 1, 2)}
    scores = {s: [1.0] * round(20 * a) + [0.0] * (20 - round(20 * a)) for s, a in test.items()}
    return Result(
        arm=arm,
        steps=steps,
        test={s: sum(v) / 20 for s, v in scores.items()},
        test_scores=scores,
        validation=accuracy,
        compute=[step_compute(tokens_per_step) for _ in range(steps)],
        wall_s=1.0,
        notes={"reward_mean": 0.25, "nonzero_advantage_frac": 0.5},
    )


@pytest.fixture
def bench(tmp_path: Path) -> Bench:
    bench = Bench(tmp_path / "out", SCALE, log=lambda _: None)
    (bench.out / "start.json").write_text(json.dumps([0.0] * SCALE.n_test))
    (bench.out / "start-validation.json").write_text(json.dumps([0.0] * SCALE.n_val))
    return bench


def keep_grid(bench: Bench, recipe: str, accuracy: float, tokens: float) -> None:
    """The recipe's tuning runs, its middle lr best by validation (no edge to extend)."""
    middle = sorted(baselines.LRS[recipe])[1]
    for arm in bench.grid(recipe):
        result = fake_result(arm, accuracy, tokens)
        result.validation += 0.01 * (arm.lr == middle)
        keep(bench, result)


def keep(bench: Bench, result: Result) -> None:
    baselines.run_dir_of(bench.out, result.arm).mkdir(parents=True, exist_ok=True)
    save_result(bench.out, result)


def test_validation_and_test_sets_are_disjoint(bench: Bench) -> None:
    test = {t.prompt for t in bench.test}
    assert len(bench.validation) == SCALE.n_val and not test & {t.prompt for t in bench.validation}


def test_t_interval_matches_the_student_t_formula() -> None:
    mean, low, high = t_interval([0.2, 0.3, 0.4])
    half = 4.302652729911275 * 0.1 / math.sqrt(3)  # t(0.975, 2) x sd / sqrt(n)
    assert mean == pytest.approx(0.3) and (low, high) == pytest.approx((0.3 - half, 0.3 + half))
    assert math.isnan(t_interval([0.5])[1])  # one seed: no interval, never a fake one


def test_accuracy_at_equal_compute_interpolates_and_never_extrapolates() -> None:
    result = fake_result(Arm("rl", 1e-4), 0.4, 1000)  # 0 / 0.2 / 0.4 at 0 / 2000 / 4000
    assert at_compute(result, 3000) == pytest.approx(0.3)
    assert math.isnan(at_compute(result, 5000))


def test_tuning_picks_by_validation_with_ties_to_the_lower_lr(bench: Bench) -> None:
    for lr, acc in zip(baselines.LRS["sft"], (0.3, 0.5, 0.5), strict=True):
        keep(bench, fake_result(Arm("sft", lr), acc, 100))
    assert bench.tuned("sft") == Arm("sft", baselines.LRS["sft"][1])
    with pytest.raises(SystemExit, match="tuning rl is not finished"):
        bench.tuned("rl")


def test_a_best_setting_at_the_grids_edge_extends_the_grid_beyond_it(bench: Bench) -> None:
    for arm in bench.grid("rl"):  # the lowest lr (1e-4) is best
        keep(bench, fake_result(arm, 0.3 if arm.lr == 1e-4 else 0.1, 100))
    extended = bench.grid("rl")
    assert [a.lr for a in extended[:2]] == [3e-5, 3e-5] and len(extended) == 8
    with pytest.raises(SystemExit, match="not finished"):
        bench.tuned("rl")
    for arm in extended[:2]:  # 3e-5 is worse: the optimum is inside, the grid stops
        keep(bench, fake_result(arm, 0.2, 100))
    assert bench.grid("rl") == extended and bench.tuned("rl") == Arm("rl", 1e-4, group=4)
    for _ in range(3):  # SFT: the lowest lr best, again and again: two more at most
        for arm in bench.grid("sft"):
            if baselines.load_result(bench.out, arm) is None:
                keep(bench, fake_result(arm, 0.5 - arm.lr, 100))
    assert [a.lr for a in bench.grid("sft")] == [3e-5, 1e-4, 3e-4, 1e-3, 3e-3]


def test_a_kept_result_is_reused_not_retrained(bench: Bench) -> None:
    arm = Arm("opd", 1e-3)
    kept = fake_result(arm, 0.5, 100)
    keep(bench, kept)
    assert bench.run(arm, curve=True) == kept  # every score there: nothing to do


def test_the_report_pairs_seeds_and_names_what_is_missing(bench: Bench, tmp_path: Path) -> None:
    accuracy = {"opd": 0.5, "rl": 0.2, "sft": 0.6, "ssd": 0.3}
    tokens = {"opd": 2000.0, "rl": 1000.0, "sft": 500.0, "ssd": 1000.0}
    for recipe in baselines.RECIPES:
        keep_grid(bench, recipe, accuracy[recipe], tokens[recipe])
    arms = bench.compare_arms()
    for recipe, group in arms.items():
        for arm in group:
            if recipe == "opd_rl" and arm.seed == 1:
                continue  # not run yet
            steps = 8 if recipe == "rl" else 4  # rl extended to OPD's compute
            acc, per_step = accuracy.get(recipe, 0.55), tokens.get(recipe, 2000)
            result = fake_result(arm, acc, per_step, steps)
            if tuning := baselines.load_result(bench.out, arm):  # seed 0: the tuning run
                result.validation = tuning.validation
            keep(bench, result)
    report = write_report(bench, tmp_path / "report", log=lambda _: None)
    data = json.loads((tmp_path / "report/results.json").read_text())
    assert data["equal_compute"]["budget"] == 8000
    rl = data["equal_compute"]["rl"]
    assert rl["steps_at_budget"] == [8, 8] and all(v == pytest.approx(0.4) for v in rl["test"])
    assert math.isnan(data["equal_compute"]["sft"]["test"][0])  # 2000 tokens: never reached
    assert data["equal_steps"]["opd_rl"]["test"] == [pytest.approx(0.55)]
    assert data["equal_steps"]["rl"]["diff_vs_opd"] == [pytest.approx(-0.3)] * 2
    text = report.read_text()
    compared = {arm.key for group in arms.values() for arm in group}
    assert compared & set(data["missing"]) == {arms["opd_rl"][1].key}
    ablated = {a.key for block in bench.ablation_blocks() for arms in block.values() for a in arms}
    tuning = {arm.key for recipe in baselines.RECIPES for arm in bench.grid(recipe)}
    assert ablated - compared - tuning <= set(data["missing"])  # the ablations have not run
    assert "ssd-lr0.001-t1.1-s0" in ablated & tuning  # SSD's top rate, kept from tuning
    assert f"`{arms['opd_rl'][1].key}`" in text.split("Not run yet:")[1]
    assert "RL at its tuned setting learns" in text  # 0% at the start, 20% at every seed
    assert "Equal compute" in text and (tmp_path / "report/results.png").is_file()


def test_extend_trains_each_baseline_on_until_it_reaches_opds_compute(
    bench: Bench, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bench's run/extend/trim logic for real; only training and scoring are stand-ins
    (a run's step s costs 1000 - 50 s tokens, and scores s/20 on every set)."""
    trained: list[tuple[str, int]] = []

    def train(arm: Arm, steps: int, run_dir: Path, *_: object) -> None:
        trained.append((arm.key, steps))
        compute = baselines.Compute(run_dir / "compute.jsonl")
        for step in range(steps):
            compute.add(step, step_compute(1000.0 - 50 * step))
        for step in {*baselines.eval_steps(steps, SCALE.eval_every), steps}:
            baselines.ckpt_dir(run_dir, step).mkdir(parents=True, exist_ok=True)

    async def accuracy(model_dir: Path, tasks: list[object], job: object = None) -> list[float]:
        step = int(model_dir.name.split("_")[1]) if model_dir.name.startswith("step_") else 0
        return [1.0] * step + [0.0] * (len(tasks) - step)

    monkeypatch.setattr(
        baselines, "train_imitation", lambda arm, steps, run_dir, *a: train(arm, steps, run_dir)
    )
    monkeypatch.setattr(baselines, "train_local_run", train)
    monkeypatch.setattr(baselines, "heldout_scores", accuracy)
    for recipe in baselines.RECIPES:
        keep_grid(bench, recipe, 0.2, 1000.0)
        for arm in bench.grid(recipe):  # tuning scored the end only
            kept = baselines.load_result(bench.out, arm)
            assert kept is not None
            kept.test_scores = {0: [0.0] * 20, 4: [1.0] * 4 + [0.0] * 16}
            keep(bench, kept)
    opd = bench.tuned("opd")
    for seed in range(SCALE.seeds):  # OPD costs 4 x 2000 tokens: the budget is 8000
        keep(bench, fake_result(replace(opd, seed=seed), 0.5, 2000.0))
    with pytest.raises(SystemExit, match="no such recipe"):
        bench.tune(["opd_rl"])  # not tuned: it takes OPD's lr and RL's group size
    with pytest.raises(SystemExit, match="no such baseline"):
        bench.extend(["opd"])  # OPD is the budget, not a baseline to extend
    bench.extend(["sft"])  # one process's share
    assert trained and {key.split("-")[0] for key, _ in trained} == {"sft"}
    bench.extend()
    sft = bench.run(replace(bench.tuned("sft"), seed=1))
    # 1000 + 950 + ...: 8000 tokens at step 11 (8250), after tries at 9 (7200) and 10 (7750)
    assert sft.compute_at(sft.steps) >= 8000 > sft.compute_at(sft.steps - 1)
    assert sft.steps == 11 and set(sft.test) == {0, 2, 4, 11}  # the curve, then the end only
    assert sft.test[sft.steps] == pytest.approx(sft.steps / 20)
    kept_ckpts = sorted(
        p.name for p in (baselines.run_dir_of(bench.out, sft.arm) / "checkpoints").iterdir()
    )
    assert kept_ckpts[-1] == f"step_{sft.steps:05d}"
    # the seed-0 tuning run got its missing curve point without being retrained past its end
    seed0 = baselines.load_result(bench.out, bench.tuned("sft"))
    assert seed0 is not None and 2 in seed0.test_scores


def test_two_bench_processes_never_train_one_run_at_once(tmp_path: Path) -> None:
    """Two parts on one --out: a run held by another process is waited for (and said so),
    then this process gets it; holding it again inside this process does not deadlock."""
    import subprocess
    import threading
    import time

    run_dir = tmp_path / "runs" / "opd-lr0.0001-s0"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; sys.path.insert(0, sys.argv[1]); import baselines; "
            "from pathlib import Path\n"
            "with baselines.exclusive(Path(sys.argv[2])):\n"
            "    print('held', flush=True); time.sleep(float(sys.argv[3]))",
            str(Path(baselines.__file__).parent),
            str(run_dir),
            "1.5",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        said: list[str] = []
        got = threading.Event()

        def take() -> None:
            with (
                baselines.exclusive(run_dir, said.append),
                baselines.exclusive(run_dir, said.append),  # reentrant
            ):
                got.set()

        worker = threading.Thread(target=take)
        worker.start()
        time.sleep(0.5)
        assert not got.is_set()  # the other process still holds it
        worker.join(timeout=20)
        assert got.is_set()
        assert said == ["opd-lr0.0001-s0: another bench process holds it, waiting"]
    finally:
        holder.kill()
        holder.wait(timeout=10)


def test_a_run_another_process_holds_is_left_to_the_end_not_queued_behind(
    bench: Bench, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two compare (or ablate) processes share a part: this one runs the arms nobody holds
    first, then waits for the held one and reuses what it finds."""
    import fcntl

    arms = [Arm("opd", 1e-4, seed=s) for s in range(3)]
    held = baselines.run_dir_of(bench.out, arms[0])
    held.parent.mkdir(parents=True, exist_ok=True)
    other = open(held.with_name(held.name + ".lock"), "a")  # noqa: SIM115 (closed mid-test)
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another open file: flock conflicts
    order: list[int] = []

    def run(arm: Arm, steps: int | None, curve: bool) -> Result:
        order.append(arm.seed)
        if arm.seed == 2:
            other.close()  # the other process ends its run
        return fake_result(arm, 0.5, 10.0)

    monkeypatch.setattr(bench, "_run", run)
    said: list[str] = []
    bench.log = said.append
    bench.run_all(arms)
    assert order == [1, 2, 0]
    assert said == ["opd-lr0.0001-s0: another bench process is running it, left to the end"]


def test_extend_leaves_a_run_another_process_is_extending_to_the_end(
    bench: Bench, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two extend processes share the part whatever their --recipes: the one that finds a
    run held extends the others first, then waits for it (and reuses what it finds)."""
    import fcntl

    for recipe in baselines.RECIPES:
        keep_grid(bench, recipe, 0.2, 1000.0)
    arms = bench.compare_arms()["sft"]
    held = baselines.run_dir_of(bench.out, arms[0])
    held.parent.mkdir(parents=True, exist_ok=True)
    other = open(held.with_name(held.name + ".lock"), "a")  # noqa: SIM115 (closed mid-test)
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another open file: flock conflicts
    order: list[int] = []

    def extend(arm: Arm, budget: float, cap: int) -> None:
        order.append(arm.seed)
        if arm.seed == arms[-1].seed:
            other.close()  # the other process ends its run

    monkeypatch.setattr(bench, "budget", lambda: 8000.0)
    monkeypatch.setattr(bench, "_extend", extend)
    said: list[str] = []
    bench.log = said.append
    bench.extend(["sft"])
    assert len(arms) > 1 and order == [a.seed for a in arms[1:]] + [arms[0].seed]
    assert said == [f"{arms[0].key}: another bench process is extending it, left to the end"]


def test_ablation_blocks_pair_with_the_reports_spec_at_both_ssd_rates(bench: Bench) -> None:
    for recipe in baselines.RECIPES:
        keep_grid(bench, recipe, 0.2, 1000.0)
    ssd = bench.tuned("ssd")
    blocks = bench.ablation_blocks()
    firsts = [next(iter(block.values()))[0] for block in blocks]
    # temperature, masking at the tuned lr; the same at the grid's top; think keep/drop
    assert [a.lr for a in firsts[:4]] == [ssd.lr, ssd.lr, 1e-3, 1e-3]
    assert all(a.temperature == 1.1 and a.mask_invalid for a in firsts[:4])
    assert firsts[4].recipe == "opd" and firsts[4].think == "drop"
    for block in blocks:
        assert all(len(arms) == SCALE.seeds for arms in block.values())
        assert len({arms[0].key for arms in block.values()}) == len(block)
    # tuned at the grid's top already: SSD's blocks are not run twice
    monkeypatch_lr = replace(ssd, lr=baselines.SSD_MOVING_LR)
    bench.tuned = lambda recipe: monkeypatch_lr if recipe == "ssd" else Arm("opd", 1e-4)  # type: ignore[method-assign]
    assert len(bench.ablation_blocks()) == 3


# -- the SWE platform --------------------------------------------------------------------

SWE_SCALE = Scale(steps=2, eval_every=1, n_test=6, n_val=6, seeds=2)


@pytest.fixture
def swe_bench(tmp_path: Path) -> Bench:
    return Bench(tmp_path / "swe", SWE_SCALE, log=lambda _: None, harness="swe")


def test_swe_splits_are_the_demos_heldout_tasks_and_disjoint_others(swe_bench: Bench) -> None:
    from slime_ext.local.evaluate import heldout_tasks

    assert swe_bench.test == heldout_tasks(SWE_SCALE.n_test, "swe")  # what `opd demo swe` scores
    test_prompts = {t.prompt for t in swe_bench.test}
    assert len(swe_bench.validation) == SWE_SCALE.n_val
    assert not test_prompts & {t.prompt for t in swe_bench.validation}
    trained = {t.task_id for t in baselines.train_tasks("swe", 0, 200)}
    assert not trained & {t.task_id for t in swe_bench.test + swe_bench.validation}


def test_one_out_holds_one_harness(swe_bench: Bench) -> None:
    with pytest.raises(SystemExit, match="use another --out"):
        Bench(swe_bench.out, SWE_SCALE, log=lambda _: None)  # math on SWE's runs


def test_swe_ablations_are_masking_and_kl_discount_not_temperature_or_think(
    swe_bench: Bench,
) -> None:
    for recipe in baselines.RECIPES:
        middle = sorted(baselines.SWE_LRS[recipe])[1]
        for arm in swe_bench.grid(recipe):
            result = fake_result(arm, 0.2, 1000.0)
            result.validation += 0.01 * (arm.lr == middle)
            keep(swe_bench, result)
    opd, ssd = swe_bench.tuned("opd"), swe_bench.tuned("ssd")
    blocks = swe_bench.ablation_blocks()
    names = [list(block) for block in blocks]
    assert names == [
        ["ssd, tier-1/2 masked", "ssd, tier-1/2 trained"],
        ["ssd, tier-1/2 masked, lr 0.0003", "ssd, tier-1/2 trained, lr 0.0003"],
        [
            "opd sampled, kl_discount 0",
            "opd sampled, kl_discount 0.9",
            "opd sampled, kl_discount 0.99",
        ],
    ]
    assert blocks[0]["ssd, tier-1/2 masked"][0] == ssd
    kl = list(blocks[2].values())
    assert [arms[0].kl_discount for arms in kl] == [0.0, 0.9, 0.99]
    assert all(a.lr == opd.lr and a.opd_loss == "sampled" for arms in kl for a in arms)
    assert [a.seed for a in kl[1]] == list(range(SWE_SCALE.seeds))
    # each arm is a job `opd train` accepts, and its key names what differs
    job = baselines.run_job(kl[2][1], 2, swe_bench.out / "x", swe_bench.platform)
    assert (job.algorithm.opd_loss, job.algorithm.kl_discount, job.model.seed) == (
        "sampled",
        0.99,
        1,
    )
    assert kl[2][1].key == f"opd-lr{opd.lr:g}-sampled-kd0.99-s1"
    rl = baselines.run_job(Arm("rl", 1e-4, group=4), 2, swe_bench.out / "y", swe_bench.platform)
    assert (rl.rollout.tasks_per_step, rl.rollout.samples_per_task) == (2, 4)
    assert rl.rollout.harness == "swe" and rl.logging.wandb_mode == "disabled"


def _attempt(task: Any, span: int, resolved: bool) -> Any:
    from rollout.trajectory import Trajectory, TrajectoryStatus, Turn

    return Trajectory(
        trajectory_id=f"{task.task_id}-0",
        task=task,
        trunk_ids=[1, 2, 3, 7, 8],
        turns=[Turn(context_len=3, span_ids=[7] * span, think_len=0)],
        status=TrajectoryStatus.COMPLETED,
        status_reason="submitted",
        reward=1.0 if resolved else 0.0,
    )


def test_teacher_traces_keep_resolved_ones_and_charge_every_attempt(
    swe_bench: Bench, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SFT on SWE trains on the teacher's resolved samples in task order; each trace costs
    the teacher's generated tokens of its attempt and of the failed ones before it; a file
    short of traces is grown by the yield so far, resuming what is there."""
    from rollout.trajectory import read_jsonl, write_jsonl

    asked: list[int] = []
    resolved_every = [3]

    def fake_sample(policy: Path, count: int, sampling: Any, seed: int, out: Path, _: Any) -> None:
        assert sampling == baselines.TEACHER_SAMPLING and policy == swe_bench.teacher
        asked.append(count)
        done = {t.task.task_id for t in read_jsonl(out)} if out.is_file() else set()
        tasks = baselines.train_tasks("swe", seed, count)
        every = resolved_every[0]
        write_jsonl(
            out,
            [
                _attempt(task, span=i + 1, resolved=every > 0 and i % every == every - 1)
                for i, task in enumerate(tasks)
                if task.task_id not in done
            ],
        )

    monkeypatch.setattr(baselines, "sample", fake_sample)
    path = swe_bench.out / "teacher-traces" / "s0.jsonl"
    path.parent.mkdir(parents=True)
    kept, costs = baselines.teacher_traces(0, 4, path, swe_bench.teacher, swe_bench.platform)
    assert asked == [4, 19]  # 1 of 4 resolved: ceil(1.1 x 4 / (1/4)) + 1 tasks next
    tasks = baselines.train_tasks("swe", 0, 12)
    assert [t.task.task_id for t in kept] == [tasks[i].task_id for i in (2, 5, 8, 11)]
    assert costs == [1 + 2 + 3, 4 + 5 + 6, 7 + 8 + 9, 10 + 11 + 12]
    assert len(list(read_jsonl(path))) == 19  # the first 4 resumed, not sampled again

    resolved_every[0] = 0  # a teacher that resolves nothing: refused, not looped
    asked.clear()
    with pytest.raises(RuntimeError, match="resolved 0 of 16 tasks, short of the 2 traces"):
        baselines.teacher_traces(
            1, 2, path.with_name("s1.jsonl"), swe_bench.teacher, swe_bench.platform
        )
    assert asked[0] == 2 and asked[-1] == 16 and asked == sorted(set(asked))  # grew, capped
