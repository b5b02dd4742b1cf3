"""Test-only: what every gloo rank of the Megatron tests imports, imported ONCE, in the
forkserver the ranks fork from (tests/slime_driver.spawn_ranks). A spawned rank would
import torch, megatron-core and slime's training side again (about 6 s of CPU each, 4
ranks a layout on this 2-core machine); a forked one starts with them loaded. Nothing runs
here but imports (no process group, no model, no thread pool: a fork is clean), in the
order a rank imports them: slime's CPU stand-ins first (tests/slime_cpu.py)."""

from __future__ import annotations

from tests import slime_cpu

slime_cpu.install()

import megatron.core.distributed  # noqa: E402
import megatron.core.models.gpt  # noqa: E402
import megatron.core.optimizer  # noqa: E402
import megatron.core.optimizer_param_scheduler  # noqa: E402
import megatron.core.parallel_state  # noqa: E402
import megatron.core.transformer.transformer_config  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401

if slime_cpu.slime_installed():
    import slime.backends.megatron_utils.actor
    import slime.backends.megatron_utils.data
    import slime.backends.megatron_utils.loss
    import slime.backends.megatron_utils.model  # noqa: F401
