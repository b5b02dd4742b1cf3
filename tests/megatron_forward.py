"""Test-only program (run by tests/slime_job.megatron_logits under torchrun, one process, the
CPU runtime installed): a torch_dist checkpoint slime saved, loaded by Megatron-LM into the
model slime's provider builds, and its logits on a prompt.

    torchrun --nproc-per-node 1 tests/megatron_forward.py OUT.pt PROMPT_IDS MEGATRON_ARGS...

MEGATRON_ARGS are MODEL_ARGS, the CPU runtime's settings, --spec, --hf-checkpoint and
--load (the save directory; its latest iteration is loaded). OUT.pt gets the logits
[len(PROMPT_IDS), vocab] in fp32.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    out, prompt = sys.argv[1], [int(t) for t in sys.argv[2].split(",")]
    sys.argv = [sys.argv[0], *sys.argv[3:]]
    import torch
    import torch.distributed as dist
    from megatron.core.enums import ModelType
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.training import get_model
    from slime.backends.megatron_utils.initialize import init
    from slime.backends.megatron_utils.model_provider import get_model_provider_func

    sys.path.insert(0, os.path.join(os.getcwd(), "tools"))
    from convert_hf_to_torch_dist import get_args  # slime's own argument set-up

    dist.init_process_group(backend="gloo", world_size=1, rank=0)
    args = get_args()
    args.no_load_optim, args.no_load_rng = True, True
    init(args)
    provider = get_model_provider_func(args)
    model = get_model(provider, ModelType.encoder_or_decoder, wrap_with_ddp=False)
    load_checkpoint(model, None, None)
    tokens = torch.tensor([prompt])
    bounds = torch.tensor([0, len(prompt)], dtype=torch.int32)
    packed = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
        max_seqlen_q=len(prompt), max_seqlen_kv=len(prompt),
    )  # fmt: skip
    with torch.no_grad():
        logits = model[0].eval()(
            input_ids=tokens, position_ids=torch.arange(len(prompt))[None],
            attention_mask=None, packed_seq_params=packed,
        )  # fmt: skip
    torch.save(logits[0].float(), out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
