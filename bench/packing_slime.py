"""Tree-packed vs per-turn samples on the slime path, measured in one run.

1. Tokens processed per loss token. Synthetic trajectories (bench/packing.py's
   `synthetic`: a `--prompt`-token prompt; each turn samples `--think` + `--action` tokens
   and gets an `--observation`; think dropped) of each of `--turns` become slime Samples
   through our hooks' own `slime_ext.slime.samples.to_samples` (OPD: loss kind kl, teacher
   log-probs), layout per_turn and packed. Printed per trajectory: processed tokens (the
   samples' tokens) / loss tokens (their loss masks) per turn and packed, the lower bound
   (every token once: the trunk as far as the last turn needs it, plus each span the trunk
   does not hold after its context) / loss tokens, and packed / lower bound against the
   goal (issue: tree-packed training) of at most 1.2. Again with think kept (the trunk
   holds each span right after its context): there per_turn is already one sample.
2. Step time. Forward + backward of a tiny megatron-core GPTModel (TP1, a one-rank gloo
   group, tests/megatron_cpu.py's CPU redirects, tests/test_megatron_step.py's model) on
   the samples of a think-dropped trajectory of each of `--step-turns`, in Megatron's THD
   micro-batches as slime hands them to the model (tokens concatenated, int32 cu_seqlens
   per sample, the packed samples' trees on packed_seq_params.opd_tree; no padding);
   loss: the next-token NLL at the loss mask. Both layouts run the same model with our
   tree attention (its dense kernel, the CPU path), causal per sample for samples
   without a tree. That kernel materializes [heads, T, T] scores over a whole
   micro-batch, so the step part's trajectories are the full-size ones with every size
   scaled down to about `--step-tokens` tokens every token once, and micro-batches hold at
   most `--micro-batch-tokens` (default: the packed sample's length, so per turn is
   several micro-batches, as slime's max_tokens_per_gpu splits them). Printed per layout:
   tokens, score entries (sum of T^2 over micro-batches: the dense kernel's work), wall
   and process CPU time (best of `--repeats` after a warm-up, the repeats interleaving
   the layouts), the loss; then per turn / packed ratios, and how far the two losses
   differ (equal: the trees are right and both steps compute the same thing).

    .venv/bin/python bench/packing_slime.py [--turns 10 40 57] [--step-turns 10 40]
        [--step-tokens 2000] [--micro-batch-tokens 0] [--repeats 2]

Printed on the 2-core dev machine (shared with other jobs, load ~15, so times are noisy),
defaults, about 1 minute:

    sizes: prompt 1000, per turn think 200 + action 100 + observation 300 tokens;
    processed: the samples' tokens, loss: their loss-mask tokens, lower: every token once

                                     processed / loss tokens
    trajectory       trunk   loss  per_turn    packed     lower  packed/lower <= 1.2  stems  samples
    10 turns, drop    5000   3000     10.33     2.537     2.533        1.0013    yes    +10       10
    40 turns, drop   17000  12000     30.33     2.387     2.383        1.0014    yes    +40       40
    57 turns, drop   23800  17100     41.67     2.372     2.368        1.0014    yes    +57       57
    10 turns, keep    7000   3000      2.23     2.233     2.233        1.0000    yes     +0        1
    40 turns, keep   25000  12000      2.06     2.058     2.058        1.0000    yes     +0        1
    57 turns, keep   35200  17100      2.04     2.041     2.041        1.0000    yes     +0        1
    (stems: packed minus lower, one token per branch; samples: per_turn's; with think kept,
    per_turn is already one sample per trajectory)

    step time, think dropped, all sizes scaled to about 2000 tokens every token once
    (the dense kernel's [heads, T, T] scores per micro-batch: the full sizes need tens of GB)
    model: megatron-core GPTModel, 2 layers, hidden 64, 4 heads, vocab 2048, 1 torch thread;
    both layouts through our tree attention (dense kernel; samples without a tree are causal)
    10 turns, sizes x 0.263: micro-batches of at most 2008 tokens
      layout   micro-batches  tokens scores (M)  wall s  cpu s       loss
      per_turn             6    8145       11.8    2.52   2.54  6035.4133
      packed               1    2008        4.0    1.04   1.06  6035.4131
      per_turn / packed: tokens 4.1x, scores 2.9x, wall 2.4x, cpu 2.4x; losses differ 3e-08
    40 turns, sizes x 0.070: micro-batches of at most 2042 tokens
      layout   micro-batches  tokens scores (M)  wall s  cpu s       loss
      per_turn            17   25480       40.4    7.68   7.75  6420.0112
      packed               1    2042        4.2    0.86   0.87  6420.0117
      per_turn / packed: tokens 12.5x, scores 9.7x, wall 9.0x, cpu 8.9x; losses differ 8e-08
    peak resident memory of the process: 1.23 GiB

The dense kernel computes every score of a micro-batch, masked ones too (the packed tree's
branches do not see each other; FlexAttention on CUDA skips such blocks), so the CPU time
ratio follows the score entries more than the tokens. Not run by CI; needs slime (`make
slime`).
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import resource
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from packing import synthetic  # bench/packing.py: the script's directory is on sys.path

from rollout.trajectory import Trajectory
from slime_ext.slime.samples import TREE_KEY, to_samples
from slime_ext.slime.tree_attention import TREE_ATTRIBUTE
from slime_ext.turns import Layout

ROOT = Path(__file__).resolve().parent.parent
GOAL = 1.2
"""Packed processed tokens at most this times the lower bound (issue: tree-packed training)."""
HIDDEN, HEADS, FFN = 64, 4, 256
VOCAB = 2048
"""Above synthetic()'s ids (< 800)."""


# ---- 1. tokens processed per loss token ------------------------------------------------------


def think_kept(trajectory: Trajectory) -> Trajectory:
    """The same turns with think kept: the trunk holds each whole span after its context."""
    turns, trunk = [], list(trajectory.trunk_ids[: trajectory.turns[0].context_len])
    ends = [turn.context_len for turn in trajectory.turns[1:]] + [len(trajectory.trunk_ids)]
    for turn, end in zip(trajectory.turns, ends, strict=True):
        turns.append(turn.model_copy(update={"context_len": len(trunk)}))
        # the think-dropped trunk holds action + observation from the context on
        trunk += turn.think_ids + trajectory.trunk_ids[turn.context_len : end]
    return Trajectory.model_validate(
        trajectory.model_dump() | {"trunk_ids": trunk, "turns": turns, "think_policy": "keep"}
    )


def lower_bound(trajectory: Trajectory) -> int:
    """Every token once: the trunk as far as some turn needs it, plus each span the trunk
    does not hold right after its context (think dropped: every span)."""
    trunk, branches = 0, 0
    for turn in trajectory.turns:
        end = turn.context_len + len(turn.span_ids)
        if trajectory.trunk_ids[turn.context_len : end] == turn.span_ids:
            trunk = max(trunk, end)
        else:
            trunk, branches = max(trunk, turn.context_len), branches + len(turn.span_ids)
    return trunk + branches


def slime_samples(trajectory: Trajectory, layout: Layout) -> list[Any]:
    from slime.utils.types import Sample

    base = Sample(index=0, group_index=0, prompt="p", metadata={})
    return to_samples(trajectory, base, loss_kind="kl", with_teacher=True, layout=layout)


def token_table(trajectories: dict[str, Trajectory]) -> None:
    print(
        f"{'':29s} {'processed / loss tokens':^29s}\n"
        f"{'trajectory':15s} {'trunk':>6s} {'loss':>6s} {'per_turn':>9s} {'packed':>9s} "
        f"{'lower':>9s} {'packed/lower':>13s} {'<= ' + str(GOAL):>6s} {'stems':>6s} "
        f"{'samples':>8s}"
    )
    for name, trajectory in trajectories.items():
        per_turn = slime_samples(trajectory, "per_turn")
        packed = slime_samples(trajectory, "packed")
        loss = sum(sum(s.loss_mask) for s in packed)
        if loss != sum(sum(s.loss_mask) for s in per_turn):
            raise AssertionError(f"{name}: the layouts' loss tokens differ")
        processed = {
            "per_turn": sum(len(s.tokens) for s in per_turn),
            "packed": sum(len(s.tokens) for s in packed),
        }
        lower = lower_bound(trajectory)
        ratio = processed["packed"] / lower
        print(
            f"{name:15s} {len(trajectory.trunk_ids):6d} {loss:6d} "
            f"{processed['per_turn'] / loss:9.2f} {processed['packed'] / loss:9.3f} "
            f"{lower / loss:9.3f} {ratio:13.4f} {'yes' if ratio <= GOAL else 'NO':>6s} "
            f"{processed['packed'] - lower:+6d} {len(per_turn):8d}"
        )
    print(
        "(stems: packed minus lower, one token per branch; samples: per_turn's; with think "
        "kept,\nper_turn is already one sample per trajectory)"
    )


# ---- 2. step time on megatron-core ----------------------------------------------------------


def micro_batches(samples: Sequence[Any], max_tokens: int) -> list[list[Any]]:
    """The samples in order, a new micro-batch where the next would pass max_tokens."""
    batches: list[list[Any]] = [[]]
    for sample in samples:
        if (
            batches[-1]
            and sum(len(s.tokens) for s in batches[-1]) + len(sample.tokens) > max_tokens
        ):
            batches.append([])
        batches[-1].append(sample)
    return batches


def step(model: Any, batches: Sequence[Sequence[Any]]) -> float:
    """One forward + backward per micro-batch, gradients accumulated; the summed loss."""
    from megatron.core.packed_seq_params import PackedSeqParams

    model.zero_grad(set_to_none=True)
    total = 0.0
    for batch in batches:
        lengths = [len(s.tokens) for s in batch]
        cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_kv=cu_seqlens,
            max_seqlen_q=max(lengths),
            max_seqlen_kv=max(lengths),
        )
        trees = [s.train_metadata[TREE_KEY] for s in batch if TREE_KEY in (s.train_metadata or {})]
        if trees:
            setattr(params, TREE_ATTRIBUTE, trees)
        tokens = torch.tensor([t for s in batch for t in s.tokens])
        logits = model(
            input_ids=tokens[None],
            position_ids=None,
            attention_mask=None,
            packed_seq_params=params,
        )[0]
        # the output before each response token predicts it (slime's samples, packed too)
        targets, weights = [], []
        for s in batch:
            prompt = len(s.tokens) - int(s.response_length)
            targets += [*s.tokens[1:], 0]
            weights += [0] * (prompt - 1) + list(s.loss_mask) + [0]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        picked = logprobs.gather(-1, torch.tensor(targets)[:, None])[:, 0]
        loss = -(picked * torch.tensor(weights, dtype=picked.dtype)).sum()
        loss.backward()
        total += float(loss)
    return total


def step_table(trajectories: dict[str, Trajectory], max_tokens: int, repeats: int) -> None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tests.live_server import free_port
    from tests.megatron_cpu import cpu_redirects

    # by name: mypy would follow the module's imports into tests/, outside its packages
    megatron_step = importlib.import_module("tests.test_megatron_step")
    megatron_step.init_process(0, 1, free_port(), 1, 1)
    layers = megatron_step.LAYERS
    config = TransformerConfig(
        num_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
        use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0,
        attention_dropout=0.0, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
    )  # fmt: skip
    print(
        f"model: megatron-core GPTModel, {layers} layers, hidden {HIDDEN}, {HEADS} heads, "
        f"vocab {VOCAB}, {torch.get_num_threads()} torch thread;\nboth layouts through our "
        "tree attention (dense kernel; samples without a tree are causal)"
    )
    try:
        with cpu_redirects():
            torch.manual_seed(0)
            model = megatron_step.gpt_model(config, VOCAB, packed=True, tree=True)
            for name, trajectory in trajectories.items():
                per_turn = slime_samples(trajectory, "per_turn")
                packed = slime_samples(trajectory, "packed")
                budget = max_tokens or len(packed[0].tokens)
                layouts = {
                    "per_turn": micro_batches(per_turn, budget),
                    "packed": micro_batches(packed, budget),
                }
                losses = {layout: step(model, b) for layout, b in layouts.items()}  # warm-up
                wall = dict.fromkeys(layouts, float("inf"))
                cpu = dict.fromkeys(layouts, float("inf"))
                for _ in range(repeats):
                    for layout, batches in layouts.items():
                        start_wall, start_cpu = time.perf_counter(), time.process_time()
                        step(model, batches)
                        wall[layout] = min(wall[layout], time.perf_counter() - start_wall)
                        cpu[layout] = min(cpu[layout], time.process_time() - start_cpu)
                print(
                    f"{name}: micro-batches of at most {budget} tokens\n"
                    f"  {'layout':8s} {'micro-batches':>13s} {'tokens':>7s} "
                    f"{'scores (M)':>10s} {'wall s':>7s} {'cpu s':>6s} {'loss':>10s}"
                )
                tokens, scores = {}, {}
                for layout, batches in layouts.items():
                    lengths = [sum(len(s.tokens) for s in batch) for batch in batches]
                    tokens[layout], scores[layout] = sum(lengths), sum(n * n for n in lengths)
                    print(
                        f"  {layout:8s} {len(batches):13d} {tokens[layout]:7d} "
                        f"{scores[layout] / 1e6:10.1f} {wall[layout]:7.2f} {cpu[layout]:6.2f} "
                        f"{losses[layout]:10.4f}"
                    )
                difference = abs(losses["per_turn"] - losses["packed"]) / abs(losses["packed"])
                print(
                    f"  per_turn / packed: tokens {tokens['per_turn'] / tokens['packed']:.1f}x, "
                    f"scores {scores['per_turn'] / scores['packed']:.1f}x, wall "
                    f"{wall['per_turn'] / wall['packed']:.1f}x, cpu "
                    f"{cpu['per_turn'] / cpu['packed']:.1f}x; losses differ {difference:.0e}"
                )
    finally:
        megatron_step.close_process()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, nargs="+", default=[10, 40, 57])
    parser.add_argument("--prompt", type=int, default=1000)
    parser.add_argument("--think", type=int, default=200)
    parser.add_argument("--action", type=int, default=100)
    parser.add_argument("--observation", type=int, default=300)
    parser.add_argument("--step-turns", type=int, nargs="*", default=[10, 40])
    parser.add_argument(
        "--step-tokens",
        type=int,
        default=2000,
        help="the step part's trajectories: all sizes scaled down to about this many tokens "
        "every token once",
    )
    parser.add_argument(
        "--micro-batch-tokens", type=int, default=0, help="0: the packed sample's length"
    )
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(ROOT))  # tests/: the megatron-core CPU setup

    def trajectory(turns: int, scale: float = 1.0) -> Trajectory:
        sizes = (args.prompt, args.think, args.action, args.observation)
        return synthetic(turns, *(max(1, round(n * scale)) for n in sizes))

    print(
        f"sizes: prompt {args.prompt}, per turn think {args.think} + action {args.action} "
        f"+ observation {args.observation} tokens;\nprocessed: the samples' tokens, loss: "
        "their loss-mask tokens, lower: every token once\n"
    )
    dropped = {f"{n} turns, drop": trajectory(n) for n in args.turns}
    kept = {
        f"{n} turns, keep": think_kept(t) for n, t in zip(args.turns, dropped.values(), strict=True)
    }
    token_table(dropped | kept)
    if not args.step_turns:
        return
    steps = {}
    for turns in args.step_turns:
        scale = min(1.0, args.step_tokens / lower_bound(trajectory(turns)))
        steps[f"{turns} turns, sizes x {scale:.3f}"] = trajectory(turns, scale)
    print(
        f"\nstep time, think dropped, all sizes scaled to about {args.step_tokens} tokens "
        "every token once\n(the dense kernel's [heads, T, T] scores per micro-batch: the "
        "full sizes need tens of GB)"
    )
    step_table(steps, args.micro_batch_tokens, args.repeats)
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak resident memory of the process: {peak_gib:.2f} GiB")


if __name__ == "__main__":
    main()
