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

import torch
from torch import Tensor

from slime_ext.local.factory import build_checkpoint
from slime_ext.losses import (
    generalized_jsd,
    masked_nll,
    reverse_kl_pg_loss,
    teacher_topk_kl,
    topk_shared_support_kl,
)
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
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("gpu_check needs CUDA (torch.cuda.is_available() is False)")
        print(f"device: {torch.cuda.get_device_name()} torch {torch.__version__}")
    ok = check_losses(args.tokens, args.vocab, args.device)
    ok &= check_teacher(args.requests, args.context, args.span, args.preset, args.device)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
