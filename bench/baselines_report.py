"""The report of bench/baselines.py: results.md (tables), results.png (held-out accuracy
against compute) and results.json (every number) in --report-dir. Written from the runs
kept in --out, whatever parts have finished; a part not run yet is named as missing."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from baselines import RECIPES, Arm, Result, _nanmean, at_compute, load_result, t_interval

if TYPE_CHECKING:
    from baselines import Bench

NAMES = {
    "opd": "OPD",
    "rl": "outcome RL",
    "sft": "SFT on traces",
    "ssd": "SSD",
    "opd_rl": "OPD + outcome reward",
}


def pct(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{100 * value:.1f}"


def interval(values: list[float]) -> str:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "n/a"
    mean, low, high = t_interval(values)
    if math.isnan(low):
        return f"{pct(mean)} (1 seed)"
    return f"{pct(mean)} [{pct(low)}, {pct(high)}]"


def seeds_text(values: list[float]) -> str:
    return ", ".join(pct(v) for v in values)


def mtok(value: float) -> str:
    return f"{value / 1e6:.2f}M"


class Report:
    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        self.steps = bench.scale.steps
        self.lines: list[str] = []
        self.data: dict[str, Any] = {"scale": vars(bench.scale)}
        if bench.platform.harness != "tir":
            self.data["harness"] = bench.platform.harness
        self.missing: list[str] = []

    def result(self, arm: Arm) -> Result | None:
        found = load_result(self.bench.out, arm)
        if found is None:
            self.missing.append(arm.key)
        return found

    def tuned(self, recipe: str) -> Arm | None:
        try:
            return self.bench.tuned(recipe)
        except SystemExit:
            return None

    def table(self, header: list[str], rows: list[list[str]]) -> None:
        self.lines.append("| " + " | ".join(header) + " |")
        self.lines.append("|" + "---|" * len(header))
        self.lines.extend("| " + " | ".join(row) + " |" for row in rows)
        self.lines.append("")

    # -- sections ---------------------------------------------------------------------------

    def tuning(self) -> None:
        self.lines += [
            "## Tuning (seed 0; picked by validation, reported on test)",
            "",
            "Each recipe's 3 learning rates (RL: x 2 group sizes), and where the best sat at "
            "an edge of its grid, the next rate beyond (up to 2).",
            "",
        ]
        start_test = statistics.fmean(self.bench.start_scores())
        start_val = statistics.fmean(self.bench.start_scores("validation"))
        rows = [["start", "the untrained student", pct(start_val), pct(start_test), "", "", ""]]
        data: list[dict[str, Any]] = [{"arm": "start", "validation": start_val, "test": start_test}]
        for recipe in RECIPES:
            chosen = self.tuned(recipe)
            for arm in self.bench.grid(recipe):
                found = self.result(arm)
                if found is None:
                    rows.append([NAMES[recipe], arm.setting, "not run", "", "", "", ""])
                    continue
                rows.append(
                    [
                        NAMES[recipe],
                        arm.setting + (" **(chosen)**" if arm == chosen else ""),
                        pct(found.validation),
                        pct(found.test[self.steps]),
                        pct(found.notes.get("reward_mean", math.nan)),
                        pct(found.notes.get("nonzero_advantage_frac", math.nan)),
                        f"{found.wall_s:.0f}",
                    ]
                )
                data.append(
                    {
                        "arm": arm.key,
                        "validation": found.validation,
                        "test": found.test[self.steps],
                        "reward_mean": found.notes.get("reward_mean"),
                        "nonzero_advantage_frac": found.notes.get("nonzero_advantage_frac"),
                        "chosen": arm == chosen,
                    }
                )
        self.table(
            [
                "recipe",
                "setting",
                "validation %",
                f"test % at step {self.steps}",
                "mean reward of its rollouts %",
                "trajectories with a non-zero advantage %",
                "wall s",
            ],
            rows,
        )
        self.data["tuning"] = data

    def compare_groups(self) -> dict[str, list[Result]]:
        if any(self.tuned(r) is None for r in RECIPES):
            self.missing.append("compare (tuning not finished)")
            return {}
        groups: dict[str, list[Result]] = {}
        for recipe, arms in self.bench.compare_arms().items():
            found = [self.result(arm) for arm in arms]
            groups[recipe] = [r for r in found if r is not None]
        return groups

    def equal_steps(self, groups: dict[str, list[Result]]) -> None:
        self.lines += [
            f"## Equal optimizer steps ({self.steps} steps of "
            f"{self.bench.platform.trajectories_per_step} trajectories)",
            "",
            "Held-out test accuracy (%), mean and 95% Student-t interval over seeds; the "
            "paired difference is against OPD at the same seed.",
            "",
        ]
        opd = {r.arm.seed: r.test[self.steps] for r in groups.get("opd", [])}
        rows, data = [], {}
        for recipe, results in groups.items():
            values = [r.test[self.steps] for r in results]
            diffs = [r.test[self.steps] - opd[r.arm.seed] for r in results if r.arm.seed in opd]
            compute = [r.compute_at(self.steps) for r in results]
            rows.append(
                [
                    NAMES[recipe],
                    results[0].arm.setting if results else "",
                    interval(values),
                    seeds_text(values),
                    "" if recipe == "opd" else interval(diffs),
                    mtok(statistics.fmean(compute)) if compute else "n/a",
                ]
            )
            data[recipe] = {"test": values, "diff_vs_opd": diffs, "compute": compute}
        self.table(
            [
                "recipe",
                "setting",
                "test %",
                "per seed",
                "minus OPD (points)",
                "compute (tokens)",
            ],
            rows,
        )
        self.data["equal_steps"] = data

    def equal_compute(self, groups: dict[str, list[Result]]) -> None:
        if not groups.get("opd"):
            return
        budget = statistics.fmean(r.compute_at(self.steps) for r in groups["opd"])
        self.lines += [
            f"## Equal compute ({mtok(budget)} tokens: OPD's mean at step {self.steps})",
            "",
            "Compute = student tokens processed by training + student tokens sampled + "
            "teacher tokens computed, per the code's own counters. Accuracy at the budget is "
            "interpolated between evaluated checkpoints; a run that cannot reach it within "
            f"{self.bench.scale.steps * 4} steps counts as n/a.",
            "",
        ]
        # OPD defines the budget: its value is its accuracy at --steps (a seed whose run
        # cost less than the mean never gets to the mean)
        opd = {r.arm.seed: r.test[self.steps] for r in groups["opd"]}
        rows, data = [], dict[str, Any](budget=budget)
        for recipe, results in groups.items():
            if recipe == "opd":
                values = [r.test[self.steps] for r in results]
            else:
                values = [at_compute(r, budget) for r in results]
            kept = [v for v in values if not math.isnan(v)]
            diffs = [
                v - opd[r.arm.seed]
                for r, v in zip(results, values, strict=True)
                if not math.isnan(v) and r.arm.seed in opd
            ]
            steps = [round(budget / (r.compute_at(r.steps) / r.steps), 1) for r in results]
            rows.append(
                [
                    NAMES[recipe],
                    interval(kept),
                    seeds_text(values),
                    "" if recipe == "opd" else interval(diffs),
                    ", ".join(f"{s:g}" for s in steps),
                ]
            )
            data[recipe] = {"test": values, "diff_vs_opd": diffs, "steps_at_budget": steps}
        self.table(
            ["recipe", "test % at the budget", "per seed", "minus OPD (points)", "steps"], rows
        )
        self.data["equal_compute"] = data

    def ablations(self) -> None:
        if self.tuned("ssd") is None or self.tuned("opd") is None:
            self.missing.append("ablations (tuning not finished)")
            return
        start = statistics.fmean(self.bench.start_scores())
        self.lines += [
            "## Ablations (the report's, at the CPU scale)",
            "",
            f"Test accuracy (%) at step {self.steps}; each paired difference is against the "
            "first arm of its block at the same seed. SSD's blocks ran at its tuned lr and "
            "again at the top of its tuning grid, where its training moves the student; the "
            f"last column is each arm's change from the untrained student ({pct(start)}%).",
            "",
        ]
        rows, data = [], {}
        for block in self.bench.ablation_blocks():
            base: dict[int, float] = {}
            for i, (name, arms) in enumerate(block.items()):
                results = [r for r in (self.result(a) for a in arms) if r is not None]
                values = [r.test[self.steps] for r in results]
                if i == 0:
                    base = {r.arm.seed: r.test[self.steps] for r in results}
                diffs = [
                    r.test[self.steps] - base[r.arm.seed] for r in results if r.arm.seed in base
                ]
                moved = [v - start for v in values]
                rows.append(
                    [
                        name,
                        interval(values),
                        seeds_text(values),
                        "" if i == 0 else interval(diffs),
                        interval(moved),
                    ]
                )
                data[name] = {"test": values, "diff_vs_block_first": diffs, "diff_vs_start": moved}
        self.table(
            ["arm", "test %", "per seed", "minus the block's first (points)", "minus the start"],
            rows,
        )
        self.data["ablations"] = data

    def rl_diagnostics(self, groups: dict[str, list[Result]]) -> None:
        """Did tuned RL learn, stay put or collapse, and why: the reward its rollouts
        earn and the share of trajectories whose group gives them an advantage."""
        from slime_ext.local.evaluate import paired_difference

        tuned = self.tuned("rl")
        if tuned is None:
            return
        runs = groups.get("rl") or [r for r in [self.result(tuned)] if r]  # compare, or tune
        if not runs:
            return
        start = self.bench.start_scores()
        diffs = [paired_difference(start, r.test_scores[self.steps]) for r in runs]
        rewards = [r.notes["reward_mean"] for r in runs]
        fracs = [r.notes["nonzero_advantage_frac"] for r in runs]
        collapsed = [
            r.arm.setting
            for r in (self.result(a) for a in self.bench.grid("rl"))
            if r and r.test[self.steps] < 0.5 * statistics.fmean(start)
        ]
        per_seed = "; ".join(
            f"seed {r.arm.seed}: {100 * d[0]:+.1f} [{100 * d[1]:+.1f}, {100 * d[2]:+.1f}]"
            for r, d in zip(runs, diffs, strict=True)
        )
        if all(d[1] > 0 for d in diffs):
            verdict = "RL at its tuned setting learns: above the start at every seed."
        elif all(d[2] < 0 for d in diffs):
            verdict = "RL at its tuned setting ends below the start at every seed."
        else:
            verdict = (
                "RL at its tuned setting does not collapse, and neither does it measurably "
                "learn in these steps: its change from the start is within the noise."
            )
        self.lines += [
            "## Outcome RL: did it learn, and why not",
            "",
            f"Tuned RL ({tuned.setting}), test accuracy minus the untrained "
            f"student's on the same {self.bench.platform.unit}, points with a 95% interval: "
            f"{per_seed}. "
            f"{verdict} Its rollouts (T=1) earn a mean reward of "
            f"{pct(statistics.fmean(rewards))}%, so most groups of "
            f"{runs[0].arm.group} samples fail together and give no advantage: "
            f"{pct(_nanmean(fracs))}% of its trajectories carry a non-zero group-normalized "
            "advantage; the gradient comes from a few trajectories per step. "
            + (
                f"Settings that collapsed (test below half the start): {', '.join(collapsed)}."
                if collapsed
                else "No setting collapsed."
            ),
            "",
        ]
        self.data["rl"] = {
            "tuned": tuned.setting,
            "diff_vs_start": diffs,
            "reward_mean": rewards,
            "nonzero_advantage_frac": fracs,
            "collapsed": collapsed,
        }

    def plot(self, groups: dict[str, list[Result]], path: Path) -> bool:
        if not groups:
            return False
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(figsize=(7, 4.5))
        for recipe, results in groups.items():
            if not results:
                continue
            steps = sorted(set.intersection(*(set(r.test) for r in results)))
            x = [statistics.fmean(r.compute_at(s) for r in results) / 1e6 for s in steps]
            y = [100 * statistics.fmean(r.test[s] for r in results) for s in steps]
            seeds = len(results)
            label = f"{NAMES[recipe]} ({seeds} seed{'s' if seeds > 1 else ''})"
            (line,) = axes.plot(x, y, marker="o", label=label)
            for r in results:  # each seed, its equal-compute extension included
                points = sorted((r.compute_at(s) / 1e6, 100 * a) for s, a in r.test.items())
                axes.plot(*zip(*points, strict=True), color=line.get_color(), alpha=0.25, lw=1)
        axes.set_xlabel("compute (M tokens: student trained + sampled, teacher computed)")
        axes.set_ylabel("held-out test accuracy (%): mean, and each seed")
        axes.grid(alpha=0.3)
        axes.legend()
        figure.tight_layout()
        figure.savefig(path, dpi=120)
        plt.close(figure)
        return True


def write_report(bench: Bench, report_dir: Path, log: Callable[[str], None] = print) -> Path:
    report_dir.mkdir(parents=True, exist_ok=True)
    report = Report(bench)
    scale, platform = bench.scale, bench.platform
    report.lines += [
        "# Fair baselines: results",
        "",
        f"Written by `bench/baselines.py` from the runs in `{bench.out}`: {scale.steps} steps "
        f"of {platform.trajectories_per_step} trajectories"
        + (" on mini-SWE in local sandboxes" if platform.harness == "swe" else "")
        + f", test on {scale.n_test} held-out {platform.unit}, validation on "
        f"{scale.n_val} others, {scale.seeds} seeds. docs/baselines.md explains the set-up.",
        "",
    ]
    report.tuning()
    groups = report.compare_groups()
    if groups:
        report.equal_steps(groups)
        report.equal_compute(groups)
    report.ablations()
    report.rl_diagnostics(groups)
    if report.plot(groups, report_dir / "results.png"):
        report.lines += ["![held-out accuracy against compute](results.png)", ""]
    runs = sorted((bench.out / "runs").glob("*/result.json"))
    wall = sum(json.loads(p.read_text())["wall_s"] for p in runs)
    report.lines += [f"{len(runs)} runs, {wall / 3600:.2f} h of wall time in all.", ""]
    missing = sorted(set(report.missing))
    if missing:
        report.lines += ["Not run yet: " + ", ".join(f"`{m}`" for m in missing) + ".", ""]
    report.data["runs"] = len(runs)
    report.data["wall_s"] = wall
    report.data["missing"] = missing
    (report_dir / "results.md").write_text("\n".join(report.lines))
    (report_dir / "results.json").write_text(json.dumps(report.data, indent=1, default=str))
    log(f"report: {report_dir / 'results.md'} ({len(runs)} runs, {len(missing)} missing)")
    return report_dir / "results.md"
