"""What batching buys the local HF policy: one `opd demo` rollout step (the bundled
student, 32 arithmetic problems, 32 at once, at most 4 turns of 64 tokens, the python
tool), sampled (temperature 1, as the demo trains) and greedy (as it evaluates), decoded
three ways: each request alone (batch-invariant: `rollout.rounds: false`), in rounds
(batches fixed by the schedule, rollout/rounds.py: the default), and in batches cut by
arrival time (HFPolicy(batch_invariant=False): fast but timing-dependent). Prints
generated tokens per second of each and the ratio of rounds to alone; the fastest of
`--repeats` passes per mode, the modes interleaved (machines are noisy).

    .venv/bin/python bench/policy_batching.py [--problems 32] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout.chat import ChatRenderer
from rollout.policy import HFPolicy, SamplingParams
from rollout.runner import Runner, RunnerConfig
from rollout.tasks.arithmetic import make_tasks
from slime_ext.local.loop import tir_harness
from slime_ext.models.refs import bundled_models

MODES = ("alone", "rounds", "arrival")


async def _rollout(
    policy: HFPolicy, tokenizer: object, problems: int, temperature: float, rounds: bool
) -> int:
    """Generated tokens of one demo-sized rollout step."""
    harness = tir_harness()
    config = RunnerConfig(
        concurrency=32,
        max_turns=4,
        max_new_tokens=64,
        max_context_tokens=1024,
        sampling=SamplingParams(max_new_tokens=64, temperature=temperature),
        rounds=rounds,
    )
    runner = Runner(harness, policy, ChatRenderer(tokenizer, harness.tools), config)
    trajectories = await runner.run(make_tasks(problems, "train", seed=1), rollout_step=0)
    return sum(len(turn.span_ids) for t in trajectories for turn in t.turns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    student, _ = bundled_models()
    tokenizer = AutoTokenizer.from_pretrained(student)
    model = AutoModelForCausalLM.from_pretrained(student).eval()
    for label, temperature in (("sampled (train)", 1.0), ("greedy (eval)", 0.0)):
        best: dict[str, float] = {}
        for _ in range(args.repeats):
            for mode in MODES:
                policy = HFPolicy(model, tokenizer.eos_token_id, batch_invariant=mode != "arrival")
                started = time.perf_counter()
                run = _rollout(policy, tokenizer, args.problems, temperature, mode == "rounds")
                tokens = asyncio.run(run)
                best[mode] = max(best.get(mode, 0.0), tokens / (time.perf_counter() - started))
        rates = ", ".join(f"{mode} {best[mode]:.0f}" for mode in MODES)
        print(f"{label}: tokens/s {rates}; rounds / alone {best['rounds'] / best['alone']:.2f}x")


if __name__ == "__main__":
    main()
