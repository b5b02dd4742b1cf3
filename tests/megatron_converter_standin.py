"""A stand-in for slime's tools/convert_torch_dist_to_hf.py, which needs Megatron, slime and
a torch_dist checkpoint. Same flags; its "Megatron checkpoint" is an iter_ directory
holding an HF state dict (model.safetensors) whose embedding Megatron padded
(`write_checkpoint`). Like the real one it refuses an existing output directory, writes
sharded safetensors with an index, copies config and tokenizer from --origin-hf-dir, and
cuts the embedding to --vocab-size. --log appends the input directory to a file, so tests
can count conversions.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

EMBEDDING = "model.embed_tokens.weight"
PADDED_ROWS = 8
"""Rows Megatron adds to the vocabulary (zeros here)."""
TRACKER = "latest_checkpointed_iteration.txt"


def command(log: Path | None = None) -> str:
    """The stand-in as an `opd-teacher sync --converter` template."""
    argv = f"{shlex.quote(sys.executable)} {shlex.quote(__file__)}"
    fields = "--input-dir {input_dir} --output-dir {output_dir} --origin-hf-dir {origin_hf_dir}"
    logged = f" --log {shlex.quote(str(log))}" if log is not None else ""
    return f"{argv} {fields} --vocab-size {{vocab_size}}{logged}"


def write_checkpoint(
    save_dir: Path, step: int, weights: dict[str, torch.Tensor], complete: bool = True
) -> None:
    """What slime leaves after `step` (1-based): iter_{step - 1}, then the tracker naming it
    (`complete`: False leaves a checkpoint still being written)."""
    directory = save_dir / f"iter_{step - 1:07d}"
    directory.mkdir(parents=True)
    embedding = weights[EMBEDDING]
    padded = torch.cat([embedding, torch.zeros(PADDED_ROWS, embedding.shape[1])])
    save_file({**weights, EMBEDDING: padded}, str(directory / "model.safetensors"))
    if complete:
        (save_dir / TRACKER).write_text(str(step - 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--input-dir", type=Path, required=True)
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--origin-hf-dir", type=Path, required=True)
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--log", type=Path, default=None)
    args = parser.parse_args()
    if args.output_dir.exists():
        raise SystemExit(f"Output directory {args.output_dir} already exists.")
    if args.log is not None:
        with args.log.open("a") as log:
            log.write(f"{args.input_dir}\n")
    tensors = load_file(args.input_dir / "model.safetensors")
    if args.vocab_size is not None:
        tensors[EMBEDDING] = tensors[EMBEDDING][: args.vocab_size].contiguous()
    names = sorted(tensors)
    shards = [names[: len(names) // 2], names[len(names) // 2 :]]
    args.output_dir.mkdir(parents=True)
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        filename = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: tensors[k] for k in shard}, str(args.output_dir / filename))
        weight_map.update(dict.fromkeys(shard, filename))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (args.output_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    for path in args.origin_hf_dir.iterdir():
        if path.is_file() and not path.name.endswith((".safetensors", ".index.json")):
            shutil.copy(path, args.output_dir / path.name)


if __name__ == "__main__":
    main()
