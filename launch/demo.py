"""The foundation's end-to-end piece, run by `opd demo` until the OPD trainer lands.

It builds the factory student and teacher, turns a scripted multi-turn tool conversation
into a per-turn `Trajectory` (think dropped from later contexts), scores every turn's
span with both models given that turn's context, and round-trips the trajectory through
JSONL. Nothing is trained yet.
"""

from __future__ import annotations

import json
import time
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import yaml
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.utils import logging as hf_logging

from rollout.chat import ChatRenderer, trajectory_from_conversation
from rollout.trajectory import Task, Trajectory, read_jsonl, token_accounting, write_jsonl
from slime_ext.local.factory import materialize

STUDENT = "factory:qwen3-tiny"
TEACHER = "factory:qwen3-small"


def _span_logprobs(
    model: PreTrainedModel, context_ids: list[int], span_ids: list[int]
) -> list[float]:
    """log p(span_ids[i] | context + span[:i]) for each i, log-softmax in fp32."""
    ids = torch.tensor([context_ids + span_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(context_ids) - 1 : -1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(-1, torch.tensor(span_ids)[:, None])[:, 0].tolist()


def build_demo_trajectory(tokenizer: Any, conversation: dict[str, Any]) -> Trajectory:
    """One turn per assistant message, each span the ids a model would sample to write it."""
    renderer = ChatRenderer(tokenizer, tools=conversation["tools"], think_policy="drop")
    messages = conversation["messages"]
    task = Task(task_id="farmer-cows", kind="tir", prompt=messages[1]["content"], answer="47")
    return trajectory_from_conversation(
        renderer, task, messages, "foundation-demo-0", reason="boxed answer", reward=1.0
    )


def run_foundation_demo(out: Path, seed: int = 0, console: Console | None = None) -> dict[str, Any]:
    console = console or Console()
    hf_logging.disable_progress_bar()
    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    console.print("[bold]opd demo[/bold] (foundation preview: no training yet)")
    with console.status("building factory student and teacher"):
        student_dir = materialize(STUDENT, out / "models", seed=seed)
        teacher_dir = materialize(TEACHER, out / "models", seed=seed)
        tokenizer = AutoTokenizer.from_pretrained(student_dir)
        if AutoTokenizer.from_pretrained(teacher_dir).get_vocab() != tokenizer.get_vocab():
            raise RuntimeError("factory student and teacher tokenizers differ")
        student = AutoModelForCausalLM.from_pretrained(student_dir).eval()
        teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()

    conversation = yaml.safe_load(
        resources.files("launch.data").joinpath("foundation_demo.yaml").read_text()
    )
    trajectory = build_demo_trajectory(tokenizer, conversation)
    for k, turn in enumerate(trajectory.turns):
        context_ids, span_ids = trajectory.context_ids(k), trajectory.span_ids(k)
        turn.logprobs = _span_logprobs(student, context_ids, span_ids)
        turn.teacher_logprobs = _span_logprobs(teacher, context_ids, span_ids)
    trajectory = Trajectory.model_validate(trajectory.model_dump())

    path = out / "trajectories.jsonl"
    path.unlink(missing_ok=True)
    write_jsonl(path, [trajectory])
    [reloaded] = list(read_jsonl(path))
    if reloaded != trajectory:
        raise RuntimeError(f"{path}: the trajectory did not survive the JSONL round-trip")

    table = Table(title="per-turn spans (k_t = student lp - teacher lp, on the span only)")
    for column in (
        "turn",
        "context",
        "think",
        "action",
        "obs",
        "student lp",
        "teacher lp",
        "mean k_t",
        "drift",
    ):
        table.add_column(column, justify="right")
    kl_terms: list[float] = []
    for k, turn in enumerate(trajectory.turns):
        student_lp, teacher_lp = turn.logprobs or [], turn.teacher_logprobs or []
        k_t = [s - t for s, t in zip(student_lp, teacher_lp, strict=True)]
        kl_terms += k_t
        table.add_row(
            str(k),
            str(turn.context_total_len),
            str(turn.think_len),
            str(len(turn.action_ids)),
            str(len(turn.observation_ids)),
            f"{sum(student_lp) / len(student_lp):.3f}",
            f"{sum(teacher_lp) / len(teacher_lp):.3f}",
            f"{sum(k_t) / len(k_t):+.3f}",
            "yes" if turn.drift else "no",
        )
    console.print(table)

    accounting = token_accounting(trajectory)
    per_turn_tokens = int(accounting["per_turn_processed_tokens"])
    tree_tokens = int(accounting["tree_packed_processed_tokens"])
    summary: dict[str, Any] = {
        "student": str(student_dir),
        "teacher": str(teacher_dir),
        "num_turns": trajectory.num_turns,
        "span_tokens": int(accounting["span_tokens"]),
        "trunk_tokens": int(accounting["trunk_tokens"]),
        "opd_reverse_kl": sum(kl_terms) / len(kl_terms),
        "per_turn_processed_tokens": per_turn_tokens,
        "tree_packed_processed_tokens": tree_tokens,
        "trajectory_jsonl": str(path),
        "trajectory_bytes": path.stat().st_size,
        "wall_s": time.perf_counter() - started,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    console.print(
        f"{trajectory.num_turns} turns, {summary['span_tokens']} span tokens, "
        f"opd_reverse_kl {summary['opd_reverse_kl']:+.4f} (random-init models); scoring "
        f"per turn processes {per_turn_tokens} tokens, a tree-packed sequence {tree_tokens}. "
        f"Wrote {path} and {out / 'summary.json'} in {summary['wall_s']:.1f}s.",
        highlight=False,
    )
    return summary
