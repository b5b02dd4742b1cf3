"""Single-GPU smoke check (no slime, no network): our losses in bf16 on CUDA against the
fp32 CPU reference, and the teacher server's hf backend throughput on the GPU.

    bash bench/gpu_check.sh            # what a lent GPU machine runs
    .venv/bin/python bench/gpu_check.py [--tokens 4096] [--vocab 32000] [--requests 256]

1. Losses: random student/teacher logits [N, V]; each loss and its gradient computed on
   CUDA from bf16 logits (log-softmax in fp32 inside, invariant 3) and on the CPU in fp32
   from the same bf16-rounded values. Prints the largest relative differences; fails
   (exit 1) past 1e-3 on values or 1e-2 on gradients.
2. Teacher: a factory checkpoint served by HFBackend on cuda in bf16: concurrent span
   scoring at max_batch_size 32 vs 1 (items/s, ratio), and its log-probs against fp32 on
   the CPU (largest difference).
3. Tree-packed FlexAttention (slime_ext.flex_tree): a synthetic multi-turn trajectory
   through a factory model in fp32 on the GPU, span log-probs and their gradients against
   the trunk-then-branches kernel (exact against per-turn forwards, tests/test_packing.py);
   fails past 1e-4 on log-probs or 1e-3 (relative) on gradients. Prints forward+backward
   wall time of both kernels and their ratio (--device cpu: forward only, no gradients).
4. The Megatron tree attention's kernels (slime_ext.slime.tree_attention, what slime's
   layers run on packed samples): FlexAttention against the dense kernel on a micro-batch
   of synthetic packed trajectories, outputs and q/k/v gradients (GQA, fp32); fails past
   1e-4 on outputs or 1e-3 (relative) on gradients; prints both kernels' fwd+bwd time.
5. A hybrid student packed (slime_ext.hybrid_tree): a tiny Qwen3.5-architecture model
   (Gated DeltaNet beside full attention) in fp32 on the GPU, a synthetic multi-turn
   trajectory's span log-probs and gradients from the packed forward (each branch from
   the trunk's states) against per-turn forwards; flash-linear-attention's gated-delta
   kernel where installed (bench/gpu_check.sh installs carried wheels from .wheels/),
   transformers' torch reference otherwise (printed). Fails past 1e-3 on log-probs or
   1e-2 on gradients relative to the largest one (the kernel's fp32 dots may run in
   TF32); prints both layouts' fwd+bwd time and their ratio.
6. The cluster path's hybrid mixing (slime_ext.gated_delta, what slime's Gated DeltaNet
   layers run on packed samples): a micro-batch of synthetic tree-packed trajectories
   through flash-linear-attention's varlen kernel (rounds with per-sequence initial
   states) against the torch reference, outputs and q/k/v/g/beta gradients in fp32;
   fails past 1e-3 (outputs) or 1e-2 (gradients, relative to the largest); prints both
   kernels' fwd+bwd time. Skipped (said) where fla is not installed.
Not run by CI.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from packing import synthetic  # bench/packing.py: the script's directory is on sys.path
from torch import Tensor

from slime_ext.flex_tree import flex_tree
from slime_ext.losses import (
    generalized_jsd,
    masked_nll,
    reverse_kl_pg_loss,
    teacher_topk_kl,
    topk_shared_support_kl,
)
from slime_ext.models.factory import build_checkpoint, build_model, build_tokenizer
from slime_ext.turns import pack_trajectory, trunk_then_branches
from slime_ext.vocab_parallel import token_logprobs
from teacher_server.api import ScoreItem
from teacher_server.hf_backend import HFBackend
from teacher_server.metrics import ServerMetrics

LossFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def _losses(temperature: float, k: int) -> dict[str, LossFn]:
    def pg(student: Tensor, teacher: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
        s = token_logprobs(student, targets, temperature=temperature)
        t = token_logprobs(teacher, targets, temperature=temperature)
        return reverse_kl_pg_loss(s, t, mask).per_token.sum()

    def nll(student: Tensor, teacher: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
        s = token_logprobs(student, targets, temperature=temperature)
        return masked_nll(s, mask).per_token.sum()

    def topk_tail(student: Tensor, teacher: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
        t = torch.log_softmax(teacher.float() / temperature, -1)
        values, ids = t.topk(k, -1)
        return teacher_topk_kl(student, ids, values, mask, temperature).per_token.sum()

    def shared_support(student: Tensor, teacher: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
        return topk_shared_support_kl(student, teacher, mask, k, temperature).per_token.sum()

    def jsd(student: Tensor, teacher: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
        return generalized_jsd(student, teacher, mask, 0.5, temperature).per_token.sum()

    return {
        "reverse_kl_pg": pg,
        "masked_nll": nll,
        "teacher_topk_kl(tail)": topk_tail,
        "topk_shared_support_kl": shared_support,
        "generalized_jsd(0.5)": jsd,
    }


def _run(fn: LossFn, student: Tensor, teacher: Tensor, targets: Tensor, mask: Tensor):  # type: ignore[no-untyped-def]
    leaf = student.detach().clone().requires_grad_(True)
    value = fn(leaf, teacher, targets, mask)
    value.backward()
    assert leaf.grad is not None
    return float(value), leaf.grad.float().cpu()


def check_losses(tokens: int, vocab: int, device: str) -> bool:
    generator = torch.Generator().manual_seed(0)
    student = (torch.randn(tokens, vocab, generator=generator) * 3).bfloat16()
    teacher = (torch.randn(tokens, vocab, generator=generator) * 3).bfloat16()
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    mask = torch.rand(tokens, generator=generator) > 0.1
    ok = True
    print(f"losses: N={tokens} V={vocab}, {device} bf16 logits vs CPU fp32 (same values)")
    for name, fn in _losses(temperature=0.8, k=16).items():
        ref_value, ref_grad = _run(fn, student.float(), teacher.float(), targets, mask)
        on = torch.device(device)
        value, grad = _run(fn, student.to(on), teacher.to(on), targets.to(on), mask.to(on))
        value_err = abs(value - ref_value) / max(abs(ref_value), 1e-6)
        grad_err = float((grad - ref_grad).abs().max() / ref_grad.abs().max().clamp(min=1e-12))
        passed = value_err <= 1e-3 and grad_err <= 1e-2
        ok &= passed
        print(
            f"  {name:26s} value rel {value_err:.2e}  grad rel(max) {grad_err:.2e}  "
            f"{'ok' if passed else 'FAIL'}"
        )
    return ok


async def _score(backend: HFBackend, items: list[ScoreItem]) -> float:
    await backend.start()
    started = time.perf_counter()
    await asyncio.gather(*(backend.score([item]) for item in items))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    await backend.stop()
    return elapsed


def check_teacher(requests: int, context: int, span: int, preset: str, device: str) -> bool:
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_checkpoint(preset, Path(tmp) / preset)
        items = [
            ScoreItem(
                input_ids=[rng.randrange(800) for _ in range(context + span)], span_start=context
            )
            for _ in range(requests)
        ]
        times = {}
        for size in (1, 32):
            backend = HFBackend(
                model_dir, ServerMetrics(), device=device, dtype="bfloat16",
                max_batch_size=size, max_queue=10**6,
            )  # fmt: skip
            asyncio.run(_score(backend, items[:8]))  # warm-up
            times[size] = asyncio.run(_score(backend, items))
        gpu = HFBackend(model_dir, ServerMetrics(), device=device, dtype="bfloat16")
        cpu = HFBackend(model_dir, ServerMetrics())

        async def both() -> tuple[list[float], list[float]]:
            await gpu.start()
            await cpu.start()
            [g] = await gpu.score(items[:1])
            [c] = await cpu.score(items[:1])
            await gpu.stop()
            await cpu.stop()
            return g.logprobs, c.logprobs

        g, c = asyncio.run(both())
    diff = max(abs(a - b) for a, b in zip(g, c, strict=True))
    print(
        f"teacher ({preset}, context {context}, span {span}, {requests} requests, {device} bf16):"
    )
    print(f"  one at a time {requests / times[1]:.1f} items/s, batched {requests / times[32]:.1f}")
    print(f"  batching ratio {times[1] / times[32]:.2f}x")
    print(f"  bf16 GPU vs fp32 CPU log-probs: max abs difference {diff:.3f}")
    return diff < 0.5


def check_flex(turns: int, preset: str, device: str) -> bool:
    # think dropped: every turn's span is a branch; observations as long as actions
    trajectory = synthetic(turns, prompt=256, think=96, action=32, observation=32)
    packed = pack_trajectory(trajectory)
    model: Any = build_model(preset, build_tokenizer(), seed=0)
    model.to(device).eval()
    spans = [token for turn in trajectory.turns for token in turn.span_ids]
    targets = torch.tensor(spans, device=device)
    kernels: dict[str, Callable[..., Tensor]] = {"kv": trunk_then_branches, "flex": flex_tree}
    training = device != "cpu"  # torch's CPU FlexAttention has no backward: forward only
    results, times = {}, {}
    for name, kernel in kernels.items():
        for _ in range(2):  # the first run compiles
            model.zero_grad()
            started = time.perf_counter()
            with torch.set_grad_enabled(training):
                rows = kernel(model, packed, rows=packed.span_rows)
                logprobs = token_logprobs(model.get_output_embeddings()(rows), targets)
            if training:
                logprobs.sum().backward()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[name] = time.perf_counter() - started
        grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
        results[name] = (logprobs.detach(), grads)
    (kv_logprobs, kv_grads), (flex_logprobs, flex_grads) = results["kv"], results["flex"]
    value_err = float((flex_logprobs - kv_logprobs).abs().max())
    grad_err = (
        max(
            float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))
            for a, b in zip(flex_grads, kv_grads, strict=True)
        )
        if training
        else 0.0
    )
    passed = value_err <= 1e-4 and grad_err <= 1e-3 and len(flex_grads) == len(kv_grads)
    print(
        f"flex tree attention ({preset}, {turns} turns, {len(packed.ids)} packed tokens, "
        f"{device} fp32):"
    )
    print(
        f"  log-probs max abs {value_err:.2e}  grad rel(max) {grad_err:.2e}  "
        f"{'ok' if passed else 'FAIL'}"
    )
    step = "fwd+bwd" if training else "fwd"
    print(
        f"  {step}: kv {times['kv'] * 1e3:.1f} ms, flex {times['flex'] * 1e3:.1f} ms, "
        f"kv / flex {times['kv'] / times['flex']:.2f}x"
    )
    return passed


def check_tree_attention(turns: int, trajectories: int, device: str) -> bool:
    from slime_ext.slime.tree_attention import TreeTable, _block_mask, _dense, _flex
    from slime_ext.turns import pack

    packs = [
        pack(t.trunk_ids, t.turns, stems=True)
        for t in (
            synthetic(turns, prompt=256, think=96, action=32, observation=32)
            for _ in range(trajectories)
        )
    ]
    starts = [0]
    for packed in packs:
        starts.append(starts[-1] + len(packed.ids))
    trees = [torch.tensor([p.positions, p.branch, p.visible_trunk]) for p in packs]
    table = TreeTable.of(starts, trees).to(device)
    rows = table.rank_rows(0, 1).to(device)
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, scale = 16, 4, 128, 128**-0.5
    base = [
        torch.randn(starts[-1], h, dim, generator=generator) for h in (heads, kv_heads, kv_heads)
    ]
    training = device != "cpu"  # torch's CPU FlexAttention has no backward
    results, times = {}, {}
    for name in ("dense", "flex"):
        for _ in range(2):  # the first flex run compiles
            q, k, v = (x.to(device).requires_grad_(training) for x in base)
            started = time.perf_counter()
            with torch.set_grad_enabled(training):
                if name == "dense":
                    out = _dense(q, k, v, table.may_attend(rows[:, None], rows[None]), scale)
                else:
                    out = _flex(q, k, v, _block_mask(table, rows, rows), scale)
                if training:
                    out.square().sum().backward()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[name] = time.perf_counter() - started
        grads = [x.grad.detach() for x in (q, k, v)] if training else []
        results[name] = (out.detach(), grads)
    (dense, dense_grads), (flex, flex_grads) = results["dense"], results["flex"]
    value_err = float((flex - dense).abs().max())
    grad_err = max(
        (
            float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))
            for a, b in zip(flex_grads, dense_grads, strict=True)
        ),
        default=0.0,
    )
    passed = value_err <= 1e-4 and grad_err <= 1e-3
    print(
        f"megatron tree attention ({trajectories} x {turns}-turn packed samples, "
        f"{starts[-1]} rows, {heads}/{kv_heads} heads, {device} fp32):"
    )
    print(
        f"  out max abs {value_err:.2e}  grad rel(max) {grad_err:.2e}  {'ok' if passed else 'FAIL'}"
    )
    step = "fwd+bwd" if training else "fwd"
    print(
        f"  {step}: dense {times['dense'] * 1e3:.1f} ms, flex {times['flex'] * 1e3:.1f} ms, "
        f"dense / flex {times['dense'] / times['flex']:.2f}x"
    )
    return passed


def check_hybrid(turns: int, device: str) -> bool:
    import importlib.util

    trajectory = synthetic(turns, prompt=256, think=96, action=32, observation=32)
    packed = pack_trajectory(trajectory)
    model: Any = build_model("qwen3_5-tiny", build_tokenizer(), seed=0)
    model.to(device).eval()
    spans = [token for turn in trajectory.turns for token in turn.span_ids]
    targets = torch.tensor(spans, device=device)

    def packed_logprobs() -> Tensor:
        rows = trunk_then_branches(model, packed, rows=packed.span_rows)
        return token_logprobs(model.get_output_embeddings()(rows), targets)

    def per_turn_logprobs() -> Tensor:
        values = []
        for k, turn in enumerate(trajectory.turns):
            context = trajectory.context_ids(k)
            sample = torch.tensor([context + turn.span_ids], device=device)
            logits = model(input_ids=sample).logits[0, len(context) - 1 : -1]
            values.append(token_logprobs(logits, sample[0, len(context) :]))
        return torch.cat(values)

    results, times = {}, {}
    for name, run in (("packed", packed_logprobs), ("per_turn", per_turn_logprobs)):
        for _ in range(2):  # the first run compiles the kernels
            model.zero_grad()
            started = time.perf_counter()
            logprobs = run()
            logprobs.sum().backward()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[name] = time.perf_counter() - started
        grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
        results[name] = (logprobs.detach(), grads)
    packed_values, packed_grads = results["packed"]
    turn_values, turn_grads = results["per_turn"]
    value_err = float((packed_values - turn_values).abs().max())
    # relative to the largest gradient of the model: some (the first layer's decay
    # parameters) are 1e-6 of it, where float rounding alone is a large share
    scale = max(float(b.abs().max()) for b in turn_grads)
    grad_err = max(
        float((a - b).abs().max()) / scale for a, b in zip(packed_grads, turn_grads, strict=True)
    )
    passed = value_err <= 1e-3 and grad_err <= 1e-2 and len(packed_grads) == len(turn_grads)
    fla = importlib.util.find_spec("fla") is not None and device == "cuda"
    kernel = "flash-linear-attention" if fla else "transformers' torch reference"
    print(
        f"hybrid packed (qwen3_5-tiny, {turns} turns, {len(packed.ids)} packed tokens, "
        f"{device} fp32, gated delta rule: {kernel}):"
    )
    print(
        f"  log-probs max abs {value_err:.2e}  grad max abs / largest grad {grad_err:.2e}  "
        f"{'ok' if passed else 'FAIL'}"
    )
    print(
        f"  fwd+bwd: packed {times['packed'] * 1e3:.1f} ms, per turn "
        f"{times['per_turn'] * 1e3:.1f} ms, per turn / packed "
        f"{times['per_turn'] / times['packed']:.2f}x"
    )
    return passed


def check_gated_delta(turns: int, trajectories: int, device: str) -> bool:
    import importlib.util

    from slime_ext.gated_delta import (
        DeltaPlan,
        chunk_gated_delta_rule_reference,
        gated_delta_kernel,
        gated_delta_rule,
    )

    if device != "cuda" or importlib.util.find_spec("fla") is None:
        print("gated delta (cluster path): skipped, needs CUDA and flash-linear-attention")
        return True
    branch: list[int] = []
    visible: list[int] = []
    cu_seqlens = [0]
    for index in range(trajectories):
        trajectory = synthetic(turns + index, prompt=256, think=96, action=32, observation=32)
        packed = pack_trajectory(trajectory)
        branch += packed.branch
        visible += packed.visible_trunk
        cu_seqlens.append(cu_seqlens[-1] + len(packed.ids))
    plan = DeltaPlan.of(cu_seqlens, branch, visible)
    rows, heads, k_dim, v_dim = cu_seqlens[-1], 4, 64, 64
    generator = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, device=device, generator=generator)

    inputs = [rand(1, rows, heads, k_dim), rand(1, rows, heads, k_dim), rand(1, rows, heads, v_dim)]
    inputs += [
        -torch.rand(1, rows, heads, device=device, generator=generator),
        rand(1, rows, heads).sigmoid(),
    ]
    results, times = {}, {}
    kernels = {
        "fla": gated_delta_kernel(torch.device(device)),
        "reference": chunk_gated_delta_rule_reference,
    }
    for name, kernel in kernels.items():
        for _ in range(2):  # the first run compiles
            leaves = [x.clone().requires_grad_() for x in inputs]
            started = time.perf_counter()
            q, k, v, g, beta = leaves
            out = gated_delta_rule(q, k, v, g, beta, plan, kernel)
            out.square().sum().backward()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[name] = time.perf_counter() - started
        results[name] = (out.detach(), [x.grad for x in leaves])
    (fla_out, fla_grads), (ref_out, ref_grads) = results["fla"], results["reference"]
    value_err = float((fla_out - ref_out).abs().max())
    scale = max(float(g.abs().max()) for g in ref_grads if g is not None)
    grad_err = max(
        float((a - b).abs().max()) / scale
        for a, b in zip(fla_grads, ref_grads, strict=True)
        if a is not None and b is not None
    )
    passed = value_err <= 1e-3 and grad_err <= 1e-2
    print(
        f"gated delta (cluster path: {trajectories} packed trajectories, {rows} rows, "
        f"{len(plan.rounds)} rounds, fp32):"
    )
    print(
        f"  outputs max abs {value_err:.2e}  grad max abs / largest grad {grad_err:.2e}  "
        f"{'ok' if passed else 'FAIL'}"
    )
    print(
        f"  fwd+bwd: fla {times['fla'] * 1e3:.1f} ms, reference {times['reference'] * 1e3:.1f} "
        f"ms, reference / fla {times['reference'] / times['fla']:.2f}x"
    )
    return passed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--span", type=int, default=256)
    parser.add_argument("--preset", default="qwen3-small")
    parser.add_argument("--turns", type=int, default=24, help="flex check's trajectory")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("gpu_check needs CUDA (torch.cuda.is_available() is False)")
        print(f"device: {torch.cuda.get_device_name()} torch {torch.__version__}")
    ok = check_losses(args.tokens, args.vocab, args.device)
    ok &= check_teacher(args.requests, args.context, args.span, args.preset, args.device)
    ok &= check_flex(args.turns, args.preset, args.device)
    ok &= check_tree_attention(args.turns, 2, args.device)
    ok &= check_hybrid(args.turns, args.device)
    ok &= check_gated_delta(args.turns, 2, args.device)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
