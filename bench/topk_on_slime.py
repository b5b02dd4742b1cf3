"""What the teacher's top-k costs on slime, against the sampled-token form, in one run.

1. Bytes per response token carried from the generate hook to the loss: a step of
   `--samples` per-turn samples (context `--context` + span `--span` tokens, OPD) goes
   through slime's own RolloutManager (convert, DP split) with our hooks, and each DP
   rank's payload is pickled as Ray's object store serializes it. Reported: payload bytes
   per response token for sampled and for k = 8, 32, 64 (tensors as slime_ext.slime.topk
   carries them: int32 ids and fp32 log-probs), and the ratio to sampled.
2. The loss step: our slime custom loss (slime_ext.slime.loss.loss) forward + backward on
   one micro-batch of logits [1, T, V] (the model's forward and backward are the same for
   both forms and are left out), `--tokens` response tokens of a `--vocab` vocabulary, in
   a fresh subprocess per variant: time (fastest of `--repeats`) and the peak resident
   memory above the inputs (glibc pinned to mmap, the kernel's high-water mark reset, as
   bench/loss_memory.py does). Reported with the ratio to sampled.

Run (about 2 minutes on 2 cores; needs slime: `make slime`):

    .venv/bin/python bench/topk_on_slime.py [--vocab 32000] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

KS = (8, 32, 64)


# ---- 1. bytes on the data path ---------------------------------------------------------------


def payload_bytes(k: int, samples: int, context: int, span: int, vocab: int) -> dict[str, float]:
    """Pickled size of the DP ranks' payloads for one step, per response token."""
    import torch
    from slime.utils.types import Sample

    from slime_ext.slime import topk
    from tests.slime_driver import rollout_manager, split_by_dp
    from tests.test_slime_real import recipe_args

    directory = Path(tempfile.mkdtemp())
    settings = {"opd_loss": "topk_tail"} if k else {}
    args = recipe_args("opd", directory, 1, 1, vocab, (), settings)
    args.max_tokens_per_gpu = (context + span) * samples
    if k:
        args.opd_job_config = str(_with_top_k(Path(args.opd_job_config), k))
    generator = torch.Generator().manual_seed(0)
    rollouts = []
    for index in range(samples):
        tokens = torch.randint(0, vocab, (context + span,), generator=generator).tolist()
        sample = Sample(
            index=index, group_index=index // 2, rollout_id=index, prompt="p",
            tokens=tokens, response_length=span, loss_mask=[1] * span,
            rollout_log_probs=(-torch.rand(span, generator=generator)).tolist(),
            teacher_log_probs=(-torch.rand(span, generator=generator)).tolist(),
            reward=1.0, status=Sample.Status.COMPLETED, metadata={"source": "x"},
        )  # fmt: skip
        if k:
            rows = topk.TopKRows(
                torch.randint(0, vocab, (span, k), generator=generator, dtype=torch.int32),
                -torch.rand(span, k, generator=generator) - 1.0,
            )
            sample.train_metadata = {topk.TOPK_KEY: rows.as_metadata()}
        rollouts.append([sample])
    args.global_batch_size = samples
    manager = rollout_manager(args, [rollouts], dp_size=1)
    flat, _ = manager._get_rollout_data(rollout_id=0)
    topk.record_step(flat)
    data = manager._convert_samples_to_train_data(flat)
    payloads = split_by_dp(manager, data)
    size = sum(len(pickle.dumps(box.inner, protocol=5)) for box in payloads)
    return {"bytes_per_token": size / (samples * span)}


def _with_top_k(path: Path, k: int) -> Path:
    import yaml

    job = yaml.safe_load(path.read_text())
    job["teacher"]["top_k"] = k
    out = path.with_name(f"job-k{k}.yaml")
    out.write_text(yaml.safe_dump(job))
    return out


# ---- 2. the loss step ------------------------------------------------------------------------


def loss_step(k: int, tokens: int, vocab: int, repeats: int) -> dict[str, float]:
    """Our slime loss, sampled (k 0) or topk_tail with k, forward + backward: seconds and
    peak resident bytes above the inputs."""
    import torch
    from loss_memory import peak_resident_bytes, reset_peak, resident_bytes, set_malloc

    set_malloc(mmap_threshold=128 * 1024, trim_threshold=128 * 1024)
    torch.set_num_threads(1)
    from slime_ext.slime import topk
    from slime_ext.slime.loss import loss
    from slime_ext.slime.settings import load_job

    directory = Path(tempfile.mkdtemp())
    job = directory / "job.yaml"
    algorithm = "  opd_loss: topk_tail\n" if k else ""
    job.write_text(
        "rollout:\n  temperature: 1.0\nalgorithm:\n  recipe: opd\n" + algorithm
        + f"teacher:\n  kind: remote\n  url: http://127.0.0.1:1\n  top_k: {max(k, 1)}\n"
    )  # fmt: skip
    load_job.cache_clear()
    os.environ["OPD_JOB_CONFIG"] = str(job)
    args = argparse.Namespace(
        rollout_temperature=1.0, use_rollout_logprobs=False, eps_clip=0.2, eps_clip_high=None,
        log_probs_chunk_size=-1, rollout_top_p=1.0,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    samples, prompt = 8, 16
    span = tokens // samples
    batch: dict[str, Any] = {
        "unconcat_tokens": [
            torch.randint(0, vocab, (prompt + span,), generator=generator) for _ in range(samples)
        ],
        "total_lengths": [prompt + span] * samples,
        "response_lengths": [span] * samples,
        "loss_masks": [torch.ones(span, dtype=torch.int) for _ in range(samples)],
        "teacher_log_probs": [-torch.rand(span, generator=generator) for _ in range(samples)],
        "rollout_log_probs": [-torch.rand(span, generator=generator) for _ in range(samples)],
        "log_probs": None,
        "advantages": None,
    }
    if k:
        batch[topk.TOPK_IDS] = [
            torch.randint(0, vocab, (span, k), generator=generator) for _ in range(samples)
        ]
        batch[topk.TOPK_LOGPROBS] = [
            -torch.rand(span, k, generator=generator) - 1.0 for _ in range(samples)
        ]
    logits = torch.randn(1, samples * (prompt + span), vocab, generator=generator)

    def run() -> None:
        given = logits.clone().requires_grad_(True)
        value, _ = loss(args, batch, given, lambda x: x.sum() / max(span, 1))
        value.backward()

    run()  # warm up
    baseline = resident_bytes()
    reset_peak()
    run()
    peak = peak_resident_bytes() - baseline
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return {"seconds": best, "peak_extra_bytes": float(max(peak, 0))}


# ---- the run -------------------------------------------------------------------------------


def _child(kind: str, k: int, options: argparse.Namespace) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", kind, "--k", str(k)]
    for name in ("vocab", "tokens", "repeats", "samples", "context", "span"):
        command += [f"--{name}", str(getattr(options, name))]
    done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{kind} k={k} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--span", type=int, default=256)
    parser.add_argument("--child", choices=["bytes", "loss"])
    parser.add_argument("--k", type=int, default=0)
    options = parser.parse_args()
    if options.child is not None:
        from tests import slime_cpu

        slime_cpu.install()
        if options.child == "bytes":
            result = payload_bytes(
                options.k, options.samples, options.context, options.span, options.vocab
            )
        else:
            result = loss_step(options.k, options.tokens, options.vocab, options.repeats)
        print(json.dumps(result))
        return
    print(
        f"data path: {options.samples} samples of {options.context} context + "
        f"{options.span} span tokens, through slime's RolloutManager (convert, DP split)"
    )
    sampled = _child("bytes", 0, options)["bytes_per_token"]
    print(f"  {'sampled':>8}: {sampled:8.1f} B per response token")
    for k in KS:
        value = _child("bytes", k, options)["bytes_per_token"]
        print(
            f"  {'k=' + str(k):>8}: {value:8.1f} B per response token "
            f"({value / sampled:.2f}x sampled, +{value - sampled:.0f} B; k x 8 = {8 * k})"
        )
    print(
        f"loss step: our slime loss forward + backward, {options.tokens} response tokens, "
        f"V={options.vocab}, one thread"
    )
    base = _child("loss", 0, options)
    print(
        f"  {'sampled':>8}: {base['seconds'] * 1e3:8.1f} ms, "
        f"peak +{base['peak_extra_bytes'] / 2**20:8.1f} MiB"
    )
    for k in KS:
        run = _child("loss", k, options)
        print(
            f"  {'k=' + str(k):>8}: {run['seconds'] * 1e3:8.1f} ms "
            f"({run['seconds'] / base['seconds']:.2f}x), peak +"
            f"{run['peak_extra_bytes'] / 2**20:8.1f} MiB "
            f"({run['peak_extra_bytes'] / max(base['peak_extra_bytes'], 1):.2f}x)"
        )


if __name__ == "__main__":
    main()
