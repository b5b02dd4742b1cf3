"""The temperature sweep's table and plot: pass@1 with its 95% interval and the
timeouts at each temperature (the reference report's 11-temperature table)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from launch.eval_report import Table
from launch.evaluation import EvalOutcome
from rollout.evaluation.scores import BenchmarkScore


def _pooled(outcome: EvalOutcome) -> BenchmarkScore:
    """The one benchmark's score, or the average row over several."""
    return outcome.scores[-1]


def sweep_table(outcomes: Sequence[tuple[float, EvalOutcome]]) -> Table:
    columns = ["Temperature", "Instances", "pass@1", "95% CI", "Net pass@1", "Timeouts", "Aborts"]
    rows: list[list[Any]] = []
    for temperature, outcome in outcomes:
        s = _pooled(outcome)
        rows.append(
            [
                f"{temperature:g}",
                s.problems,
                f"{100 * s.pass_at_1:.1f}%",
                f"[{100 * s.interval[0]:.1f}, {100 * s.interval[1]:.1f}]",
                f"{100 * s.net_pass_at_1:.1f}%",
                s.timeouts,
                s.aborts,
            ]
        )
    return columns, rows


def sweep_plot(outcomes: Sequence[tuple[float, EvalOutcome]]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = [t for t, _ in outcomes]
    scores = [_pooled(o) for _, o in outcomes]
    figure, axis = plt.subplots(figsize=(6.4, 3.6))
    axis.bar(temperatures, [s.timeouts for s in scores], width=0.05, color="0.8", label="timeouts")
    axis.set_ylabel("timeouts")
    rate = axis.twinx()
    rate.plot(temperatures, [100 * s.pass_at_1 for s in scores], marker="o", label="pass@1")
    rate.fill_between(
        temperatures,
        [100 * s.interval[0] for s in scores],
        [100 * s.interval[1] for s in scores],
        alpha=0.2,
    )
    rate.set_ylabel("pass@1 % (95% CI)")
    rate.set_ylim(0, 100)
    axis.set_xlabel("temperature")
    axis.set_title("pass@1 and timeouts per temperature")
    return figure
