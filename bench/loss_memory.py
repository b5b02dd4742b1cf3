"""Peak memory and time of our chunked and fused losses against the straightforward ones.

Measures, at V=32,000 vocabulary x N=4,096 tokens (a CPU stand-in for 151k x 38,912),
forward + backward of three losses:

- pg:   `token_logprobs` of sampled ids, then `reverse_kl_pg_loss` against random teacher
        log-probs;
- topk: `teacher_topk_kl` against the teacher's top-20 ids and log-probs, tail=True;
- jsd:  `generalized_jsd`, beta=0.5, against full teacher logits [N, V];

each in four variants:

- naive:        log_softmax on the whole fp32 logits [N, V] (requiring grad), then gather /
                the full KL, then backward;
- chunked:      our function with `chunk_size` on the same logits;
- fused_naive:  logits = hidden [N, H] @ W.T ([V, H]), then the naive loss, then backward;
- fused:        `fused_lm_head` on hidden and W, so [N, V] logits never exist whole.

Every variant runs in a fresh subprocess (torch's CPU allocations are invisible to
tracemalloc). The child pins glibc to mmap every allocation over 128 KiB (so freed tensors
leave the resident set at once and resident = live bytes), warms up on a tiny batch,
allocates its inputs, records its resident memory, resets the kernel's high-water mark
(/proc/self/clear_refs), runs one forward + backward and reads the high-water mark
(ru_maxrss). Gradients are accounted two ways, each in its own subprocess:

- pre: gradient buffers pre-allocated and touched before the baseline. Autograd still
       builds each leaf's gradient in a new buffer and then adds it into .grad, so that
       buffer shows up as extra (any autograd implementation pays it);
- ag:  .grad left None; the buffer backward hands over becomes .grad and is counted as
       the gradient (subtracted), not as extra.

Reported per variant: "extra" = peak - inputs - gradients; "total" = peak - resident
memory before any input was allocated; time = fastest of `--repeats` further passes, run
with freed chunk-sized blocks reused (as a caching allocator would). Ratios (goals):
chunked extra / naive extra <= 0.25, fused total / fused_naive total <= 0.125.

chunk_size 256 of 4,096 tokens is 10x the token fraction of 256 of 38,912; `--chunk-size 27`
keeps the real run's proportion of chunk intermediates to [N, V].

Run (about 6 minutes on 2 cores; --quick: N=512, V=8,000, chunk 64, under a minute):

    .venv/bin/python bench/loss_memory.py [--quick] [--chunk-size 256] [--hidden 512]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from slime_ext.losses import (
    generalized_jsd,
    masked_mean,
    reverse_kl_pg_loss,
    teacher_topk_kl,
)
from slime_ext.vocab_parallel import fused_lm_head, token_logprobs

LOSSES = ("pg", "topk", "jsd")
VARIANTS = ("naive", "chunked", "fused_naive", "fused")
GRADS = ("preallocated", "autograd")
GRAD_TAGS = ("pre", "ag")
MIB = 1024 * 1024
CHUNKED_GOAL = 0.25
FUSED_GOAL = 0.125


@dataclass(frozen=True)
class Shape:
    tokens: int
    vocab: int
    hidden: int
    chunk_size: int
    teacher_top_k: int = 20
    temperature: float = 1.0
    jsd_beta: float = 0.5


@dataclass(frozen=True)
class Measurement:
    loss: str
    variant: str
    grads: str
    """"preallocated" or "autograd": how gradients are accounted (module docstring)."""
    input_mib: float
    """Inputs and their gradient buffers."""
    extra_mib: float
    """Peak during forward + backward minus inputs and their gradients."""
    total_mib: float
    """Peak minus resident memory before any input was allocated."""
    seconds: float
    loss_value: float


# ---- resident memory -------------------------------------------------------------------

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc mallopt parameters


def set_malloc(mmap_threshold: int, trim_threshold: int) -> bool:
    """Pin glibc's mmap / trim thresholds (this also stops their dynamic adjustment)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(
        mallopt(M_ARENA_MAX, 2)
        and mallopt(M_MMAP_THRESHOLD, mmap_threshold)
        and mallopt(M_TRIM_THRESHOLD, trim_threshold)
    )


def resident_bytes() -> int:
    """Current resident set size (VmRSS)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_resident_bytes() -> int:
    """High-water resident set size since start or the last `reset_peak` (ru_maxrss, KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak() -> bool:
    """Reset the kernel's resident high-water mark to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


# ---- loss inputs -----------------------------------------------------------------------


def teacher_data(shape: Shape, generator: torch.Generator) -> dict[str, Tensor]:
    """Sampled ids, teacher log-probs of them, teacher top-k ids / log-probs, and a mask."""
    n, v, k = shape.tokens, shape.vocab, shape.teacher_top_k
    topk_ids = torch.rand(n, v, generator=generator).topk(k, dim=-1).indices
    # a log-distribution over the top-k holding 90% of the mass, leaving a tail
    topk_logprobs = torch.log_softmax(torch.randn(n, k, generator=generator), -1) + math.log(0.9)
    return {
        "sampled_ids": torch.randint(0, v, (n,), generator=generator),
        "teacher_logprobs": -torch.rand(n, generator=generator) * 10.0,
        "topk_ids": topk_ids,
        "topk_logprobs": topk_logprobs,
        "mask": torch.ones(n, dtype=torch.bool),
    }


def needs_teacher_logits(loss: str) -> bool:
    return loss == "jsd"


# ---- the straightforward losses on whole [N, V] logits ---------------------------------


def log_rest_mass(topk_logprobs: Tensor, floor: float = 1e-8) -> Tensor:
    """log(1 - sum exp(top-k log-probs)), floored: the log-mass outside the top-k."""
    covered = torch.logsumexp(topk_logprobs, dim=-1).clamp(max=0.0)
    return torch.log((-torch.expm1(covered)).clamp(min=floor))


def naive_per_token(loss: str, logits: Tensor, data: dict[str, Tensor], shape: Shape) -> Tensor:
    student = torch.log_softmax(logits.float() / shape.temperature, dim=-1)
    if loss == "pg":
        sampled = student.gather(-1, data["sampled_ids"][:, None])[:, 0]
        return reverse_kl_pg_loss(sampled, data["teacher_logprobs"], data["mask"]).per_token
    if loss == "topk":
        student_k = student.gather(-1, data["topk_ids"])
        teacher_k = data["topk_logprobs"]
        kl = (student_k.exp() * (student_k - teacher_k)).sum(dim=-1)
        student_rest, teacher_rest = log_rest_mass(student_k), log_rest_mass(teacher_k)
        return kl + student_rest.exp() * (student_rest - teacher_rest)
    if loss == "jsd":
        beta = shape.jsd_beta
        teacher = torch.log_softmax(data["teacher_logits"].float() / shape.temperature, dim=-1)
        mixture = torch.logaddexp(student + math.log(1.0 - beta), teacher + math.log(beta))
        terms = beta * teacher.exp() * (teacher - mixture) + (1.0 - beta) * student.exp() * (
            student - mixture
        )
        return terms.sum(dim=-1)
    raise ValueError(f"unknown loss {loss!r}")


# ---- ours: chunked over tokens, on logits or fused with the LM head ---------------------


def chunked_per_token(
    loss: str, logits: Tensor, data: dict[str, Tensor], shape: Shape, chunk_size: int | None
) -> Tensor:
    """Our loss on logits; with chunk_size None it is the unchunked per-chunk kernel."""
    temperature, mask = shape.temperature, data["mask"]
    if loss == "pg":
        sampled = token_logprobs(
            logits, data["sampled_ids"], temperature=temperature, chunk_size=chunk_size
        )
        return reverse_kl_pg_loss(sampled, data["teacher_logprobs"], mask).per_token
    if loss == "topk":
        return teacher_topk_kl(
            logits,
            data["topk_ids"],
            data["topk_logprobs"],
            mask,
            temperature,
            tail=True,
            chunk_size=chunk_size,
        ).per_token
    if loss == "jsd":
        return generalized_jsd(
            logits,
            data["teacher_logits"],
            mask,
            shape.jsd_beta,
            temperature,
            chunk_size=chunk_size,
        ).per_token
    raise ValueError(f"unknown loss {loss!r}")


def fused_per_token(
    loss: str, hidden: Tensor, weight: Tensor, data: dict[str, Tensor], shape: Shape
) -> Tensor:
    temperature, mask = shape.temperature, data["mask"]
    if loss == "pg":
        sampled = fused_lm_head(
            lambda logits, ids: token_logprobs(logits, ids, temperature=temperature),
            hidden,
            weight,
            [data["sampled_ids"]],
            shape.chunk_size,
        )
        return reverse_kl_pg_loss(sampled, data["teacher_logprobs"], mask).per_token
    if loss in ("topk", "jsd"):
        kernel_inputs = {
            "topk": ["topk_ids", "topk_logprobs", "mask"],
            "jsd": ["teacher_logits", "mask"],
        }[loss]

        def kernel(logits: Tensor, *rest: Tensor) -> Tensor:
            chunk_data = dict(zip(kernel_inputs, rest, strict=True))
            return chunked_per_token(loss, logits, chunk_data, shape, chunk_size=None)

        tensors = [data[name] for name in kernel_inputs]
        return fused_lm_head(kernel, hidden, weight, tensors, shape.chunk_size)
    raise ValueError(f"unknown loss {loss!r}")


# ---- one variant, in this process ------------------------------------------------------


def make_case(
    loss: str, variant: str, shape: Shape, seed: int
) -> tuple[Callable[[], Tensor], list[Tensor]]:
    """Allocate one variant's inputs; return its forward (to a scalar) and its leaves."""
    generator = torch.Generator().manual_seed(seed)
    data = teacher_data(shape, generator)
    if needs_teacher_logits(loss):
        data["teacher_logits"] = torch.randn(shape.tokens, shape.vocab, generator=generator)

    if variant in ("naive", "chunked"):
        logits = torch.randn(shape.tokens, shape.vocab, generator=generator).requires_grad_()
        leaves = [logits]
    elif variant in ("fused_naive", "fused"):
        hidden = torch.randn(shape.tokens, shape.hidden, generator=generator).requires_grad_()
        weight = torch.randn(shape.vocab, shape.hidden, generator=generator) * shape.hidden**-0.5
        weight.requires_grad_()
        leaves = [hidden, weight]
    else:
        raise ValueError(f"unknown variant {variant!r}")

    def forward() -> Tensor:
        if variant == "naive":
            per_token = naive_per_token(loss, logits, data, shape)
        elif variant == "chunked":
            per_token = chunked_per_token(loss, logits, data, shape, shape.chunk_size)
        elif variant == "fused_naive":
            per_token = naive_per_token(loss, hidden @ weight.t(), data, shape)
        else:
            per_token = fused_per_token(loss, hidden, weight, data, shape)
        return masked_mean(per_token, data["mask"])

    return forward, leaves


def measure(loss: str, variant: str, shape: Shape, grads: str, repeats: int) -> Measurement:
    """One variant's peak memory (one forward + backward), then its time (`repeats` more)."""
    # memory pass: every allocation over 128 KiB is its own mmap, so resident = live bytes
    if not set_malloc(mmap_threshold=128 * 1024, trim_threshold=128 * 1024):
        print("warning: not glibc; resident memory includes allocator caching", file=sys.stderr)
    # warm up code paths and thread pools on a tiny batch, chunked as the real one is
    tiny = Shape(tokens=16, vocab=min(shape.vocab, 64), hidden=8, chunk_size=4, teacher_top_k=4)
    warm_forward, _ = make_case(loss, variant, tiny, seed=1)
    warm_forward().backward()
    del warm_forward
    gc.collect()

    before_inputs = resident_bytes()
    forward, leaves = make_case(loss, variant, shape, seed=0)
    if grads == "preallocated":
        for leaf in leaves:
            leaf.grad = torch.zeros_like(leaf)
            leaf.grad.fill_(0.0)  # resident, whatever the allocator did
    gc.collect()
    with_inputs = resident_bytes()
    if not reset_peak():
        with_inputs = max(with_inputs, peak_resident_bytes())
    value = forward()
    value.backward()
    peak = peak_resident_bytes()
    loss_value = value.item()
    del value
    # "autograd": the buffers backward handed over became the gradients; count them as such
    grad_bytes = 0
    if grads == "autograd":
        grad_bytes = sum(leaf.grad.nbytes for leaf in leaves if leaf.grad is not None)

    # time pass: freed chunk-sized blocks are reused, as a caching allocator reuses them
    set_malloc(mmap_threshold=64 * MIB, trim_threshold=1024 * MIB)
    fastest = math.nan
    for _ in range(repeats):
        start = time.perf_counter()
        forward().backward()
        elapsed = time.perf_counter() - start
        fastest = elapsed if math.isnan(fastest) else min(fastest, elapsed)
    return Measurement(
        loss=loss,
        variant=variant,
        grads=grads,
        input_mib=(with_inputs - before_inputs + grad_bytes) / MIB,
        extra_mib=(peak - with_inputs - grad_bytes) / MIB,
        total_mib=(peak - before_inputs) / MIB,
        seconds=fastest,
        loss_value=loss_value,
    )


# ---- the parent: one subprocess per variant, then the table ----------------------------


def run_child(
    loss: str, variant: str, grads: str, repeats: int, args: argparse.Namespace, shape: Shape
) -> Measurement:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        f"--loss={loss}",
        f"--variant={variant}",
        f"--grads={grads}",
        f"--tokens={shape.tokens}",
        f"--vocab={shape.vocab}",
        f"--hidden={shape.hidden}",
        f"--chunk-size={shape.chunk_size}",
        f"--threads={args.threads}",
        f"--repeats={repeats}",
    ]
    repo_root = str(Path(__file__).resolve().parent.parent)
    python_path = os.pathsep.join(p for p in (repo_root, os.environ.get("PYTHONPATH")) if p)
    environment = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": python_path}
    result = subprocess.run(command, env=environment, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{loss}/{variant}/{grads} failed:\n{result.stderr}")
    return Measurement(**json.loads(result.stdout.strip().splitlines()[-1]))


def verdict(ratio: float, goal: float) -> str:
    return "PASS" if ratio <= goal else "MISS"


Results = dict[tuple[str, str, str], Measurement]
"""Measurements by (loss, variant, grads)."""


def ratio_line(results: Results, loss: str, metric: str, variants: tuple[str, str]) -> str:
    """'pre R PASS|MISS, ag R PASS|MISS; time xT' for variants[0] / variants[1]."""
    ours_name, baseline_name = variants
    goal = CHUNKED_GOAL if ours_name == "chunked" else FUSED_GOAL
    parts = []
    for grads, tag in zip(GRADS, GRAD_TAGS, strict=True):
        ours = getattr(results[loss, ours_name, grads], metric)
        baseline = getattr(results[loss, baseline_name, grads], metric)
        parts.append(f"{tag} {ours / baseline:.3f} {verdict(ours / baseline, goal)}")
    ours_time = results[loss, ours_name, "preallocated"].seconds
    baseline_time = results[loss, baseline_name, "preallocated"].seconds
    return f"{', '.join(parts)}; time x{ours_time / baseline_time:.2f}"


def print_report(results: Results, shape: Shape) -> None:
    print(
        f"N={shape.tokens} tokens, V={shape.vocab}, H={shape.hidden}, "
        f"chunk_size={shape.chunk_size}, {torch.get_num_threads()} threads; "
        f"fp32 logits [N, V] = {shape.tokens * shape.vocab * 4 / MIB:.0f} MiB"
    )
    print("gradients: pre = pre-allocated; backward's result is added into them")
    print("           ag  = left None; the buffer backward returns becomes .grad (not extra)")
    print(
        f"{'loss':<5} {'variant':<12} {'inputs+grads':>12} {'extra pre':>10} {'extra ag':>9} "
        f"{'total pre':>10} {'total ag':>9} {'time':>7} {'loss value':>11}"
    )
    print(f"{'':<18} {'MiB':>12} {'MiB':>10} {'MiB':>9} {'MiB':>10} {'MiB':>9} {'s':>7}")
    losses = list(dict.fromkeys(loss for loss, _, _ in results))
    for loss in losses:
        for variant in VARIANTS:
            pre, ag = results[loss, variant, "preallocated"], results[loss, variant, "autograd"]
            print(
                f"{loss:<5} {variant:<12} {pre.input_mib:>12.0f} {pre.extra_mib:>10.0f} "
                f"{ag.extra_mib:>9.0f} {pre.total_mib:>10.0f} {ag.total_mib:>9.0f} "
                f"{pre.seconds:>7.3f} {pre.loss_value:>11.5f}"
            )
    print()
    print(f"ratios: chunked/naive extra (goal <= {CHUNKED_GOAL}), ", end="")
    print(f"fused/fused_naive total (goal <= {FUSED_GOAL})")
    for loss in losses:
        note = "  (teacher logits [N, V]: an input of both)" if needs_teacher_logits(loss) else ""
        chunked = ratio_line(results, loss, "extra_mib", ("chunked", "naive"))
        fused = ratio_line(results, loss, "total_mib", ("fused", "fused_naive"))
        print(f"{loss:<5} chunked/naive extra: {chunked}")
        print(f"{'':<5} fused/naive total:   {fused}{note}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="N=512, V=8000: a smoke test")
    parser.add_argument("--tokens", type=int, default=None, help="N (default 4096)")
    parser.add_argument("--vocab", type=int, default=None, help="V (default 32000)")
    parser.add_argument("--hidden", type=int, default=512, help="H of the fused comparison")
    parser.add_argument("--chunk-size", type=int, default=None, help="default 256 (--quick: 64)")
    parser.add_argument("--losses", default=",".join(LOSSES), help="comma-separated subset")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="time = fastest of these")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--loss", choices=LOSSES, help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--grads", choices=GRADS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    default_tokens, default_vocab = (512, 8000) if args.quick else (4096, 32000)
    args.tokens = args.tokens or default_tokens
    args.vocab = args.vocab or default_vocab
    args.chunk_size = args.chunk_size or (64 if args.quick else 256)
    return args


def main() -> None:
    args = parse_args()
    shape = Shape(args.tokens, args.vocab, args.hidden, args.chunk_size)
    if args.child:
        torch.set_num_threads(args.threads)
        measurement = measure(args.loss, args.variant, shape, args.grads, args.repeats)
        print(json.dumps(asdict(measurement)))
        return
    losses = [loss for loss in args.losses.split(",") if loss]
    unknown = set(losses) - set(LOSSES)
    if unknown:
        raise SystemExit(f"unknown losses {sorted(unknown)}; choose from {LOSSES}")
    torch.set_num_threads(args.threads)
    results = {
        (loss, variant, grads): run_child(
            loss, variant, grads, args.repeats if grads == "preallocated" else 0, args, shape
        )
        for loss in losses
        for variant in VARIANTS
        for grads in GRADS
    }
    print_report(results, shape)


if __name__ == "__main__":
    main()
