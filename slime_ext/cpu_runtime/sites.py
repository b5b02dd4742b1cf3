"""Where megatron-core, Megatron-LM and slime need the CPU runtime, and why: each site a
module name (imported by nothing here: a process that never loads them pays nothing) and
the reason, for slime_ext.cpu_runtime.redirects to act on after the module loads."""

from __future__ import annotations

MEGATRON_CORE_SITES = {
    "megatron.core.utils": "the global memory buffer (utils.py:628-631) and the grad norm "
    'of local_multi_tensor_l2_norm (utils.py:1207) on device="cuda"',
    "megatron.core.tensor_parallel.mappings": "all-gather / reduce-scatter outputs on "
    "torch.cuda.current_device() (mappings.py:141,181): SP and the CP attention's K/V",
    "megatron.core.tensor_parallel.layers": "the SP linear backward's all-gathered input "
    "(layers.py:551-552)",
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "RotaryEmbedding.get_emb "
    "moves inv_freq to torch.cuda.current_device() (rotary_pos_embedding.py:162)",
    "megatron.core.pipeline_parallel.schedules": "forward_backward_no_pipelining's "
    'total_num_tokens on device="cuda" (schedules.py:596)',
    "megatron.core.optimizer.optimizer": "_dummy_overflow_buf, _scale_one and the constant "
    "grad scale on device='cuda' (optimizer.py:481,485,907)",
    "megatron.core.optimizer.clip_grads": "get_grad_norm_fp32's overflow buffer on "
    "device='cuda' (clip_grads.py:103)",
    "megatron.core.distributed.param_and_grad_buffer": "param and grad buffers on "
    "torch.cuda.current_device() (param_and_grad_buffer.py:797-806)",
}
"""megatron-core modules whose `torch` is redirected (the in-process tests' sites too)."""


PROCESS_SITES = {
    "megatron.training.training": "get_model moves each model chunk to "
    "torch.cuda.current_device() and wraps DDP in a torch.cuda.Stream (training.py:1259,"
    "1326-1345)",
    "megatron.training.utils": "validate_args reads the device's compute capability "
    "(get_device_arch_version, utils.py:448) when TP or CP > 1: an architecture before "
    "Blackwell here (no CUDA streams whose ordering it tunes)",
    "megatron.training.checkpointing": "save_checkpoint's RNG state reads "
    "torch.cuda.get_rng_state() (checkpointing.py:343) even with --no-save-rng",
    "megatron.core.dist_checkpointing.strategies.filesystem_async": "preload_tensors "
    "synchronizes torch.cuda before writing (filesystem_async.py:230)",
    "megatron.core.dist_checkpointing.strategies.fully_parallel": "the fully parallel save "
    "and load synchronize torch.cuda (fully_parallel.py:272,281)",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": "the save's reuse and "
    "failure flags on device='cuda' (state_dict_saver.py:204,252)",
    "megatron.core.dist_checkpointing.strategies.async_utils": "the async caller's flags on "
    "torch.cuda.current_device() and its synchronize (async_utils.py:165,212,604)",
    "megatron.core.dist_checkpointing.exchange_utils": "the load's exchange buffers on "
    'device="cuda" (exchange_utils.py:104,110,326)',
    "slime.utils.tensor_backper": "TensorBackuper's CPU copies of the weights are pinned "
    "(tensor_backper.py:61), at init and after every step",
}
"""Sites that only a whole job reaches (slime's train actors), on top of MEGATRON_CORE_SITES."""


NUMPY_SITE = (
    "slime.backends.megatron_utils.initialize",
    "initialize.py:66 asserts numpy 1.x (slime's image pins 1.26.4, for Megatron-LM#1563 "
    "in Megatron's dataset index builders, which slime's train.py never calls); this "
    "environment keeps numpy 2 (datasets and pyarrow need it), so that module's `np` "
    "reports the version slime's image pins",
)


DEFAULTS_SITE = (
    "slime.backends.megatron_utils.arguments",
    "_set_default_megatron_args forces bf16 unless fp16 (arguments.py:157) and the fully "
    "parallel checkpoint load (arguments.py:163). A CPU run keeps fp32 parameters (bf16 "
    "matmuls are emulated on CPU, and fp32 is what lets a CPU run be checked against a "
    "reference to 1e-6) and loads each rank's shards itself (the fully parallel load's "
    "exchange moves tensors with .cuda(), exchange_utils.py:336,499)",
)


OPTIMIZER_LOAD_SITE = (
    "megatron.core.optimizer.distrib_optimizer",
    "with torch's Adam (no Transformer Engine or Apex: the CPU case) state_dict() asserts "
    "one 'step' over the per-parameter states (distrib_optimizer.py:642), which a fresh "
    "optimizer has none of when a checkpoint is loaded into it; Megatron's own dummy-state "
    "init (distrib_optimizer.py:1137, its FSDP load path's) makes them first, and the load "
    "replaces them. The load then copies the saved main parameters in place outside "
    "no_grad (distrib_optimizer.py:940): with fp32 parameters (the CPU runtime's) the main "
    "parameters are views of the trained leaves and the copy raises; it runs under no_grad. "
    "And torch's Adam keeps a step per parameter, which the load writes as ONE tensor "
    "shared by every parameter's state (distrib_optimizer.py:818-822) and then copies the "
    "saved states into in place: measured here, a job resumed after 2 optimizer steps took "
    "its third with Adam's step at 1 (the bias correction of step 2) and ended 8.5e-4 away "
    "from the uninterrupted job. Each parameter's step is set to the checkpoint's (its "
    "param groups carry it) as its own tensor; TE's and Apex's Adam, the GPU case, keep "
    "the step in the param group",
)


RELOADABLE_GROUP_SITE = (
    "slime.utils.reloadable_process_group",
    "ReloadableProcessGroup forwards the collectives of the torch slime's image ships; "
    "torch 2.13 (the CPU build here) dispatches all_gather_into_tensor, "
    "reduce_scatter_tensor and all_to_all_single to methods it does not forward "
    "(all_gather_single, reduce_scatter_single, all_to_all_single and their coalesced "
    "forms), which then find no backend on the wrapper",
)
