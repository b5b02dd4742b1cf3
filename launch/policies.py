"""Where an evaluation's or a sampling run's generations come from: `--policy` (an SGLang
server URL, a local HF directory, factory:<preset>, bundled:student) and `--tokenizer`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, model_validator

from rollout.policy import Policy

URL_PREFIXES = ("http://", "https://")


class PolicySpecError(ValueError):
    """A --policy / --tokenizer combination that cannot be served."""


class PolicySource(BaseModel):
    """Where generations come from: an SGLang URL, or a local HF model run here."""

    url: str | None = None
    model_dir: Path | None = None
    tokenizer_dir: Path

    @model_validator(mode="after")
    def _one_source(self) -> PolicySource:
        if (self.url is None) == (self.model_dir is None):
            raise ValueError("a policy is either an SGLang url or a local model_dir")
        return self


def resolve_policy(
    spec: str, tokenizer_spec: str | None, models_dir: Path, seed: int
) -> PolicySource:
    """Resolve --policy / --tokenizer to directories (factory models are built here)."""
    from slime_ext.local.run_config import resolve_model

    if spec.startswith(URL_PREFIXES):
        if tokenizer_spec is None:
            raise PolicySpecError(
                "an SGLang --policy needs --tokenizer: the served model's HF directory "
                "(contexts are rendered here, ids go to the server)"
            )
        return PolicySource(url=spec, tokenizer_dir=resolve_model(tokenizer_spec, models_dir, seed))
    model_dir = resolve_model(spec, models_dir, seed)
    tokenizer_dir = (
        model_dir if tokenizer_spec is None else resolve_model(tokenizer_spec, models_dir, seed)
    )
    return PolicySource(model_dir=model_dir, tokenizer_dir=tokenizer_dir)


@contextlib.asynccontextmanager
async def open_policy(
    source: PolicySource, sampler_seed: int, concurrency: int
) -> AsyncIterator[tuple[Policy, Any]]:
    """(policy, tokenizer): SGLangPolicy at the URL, or HFPolicy on this machine."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.policy import HFPolicy, SGLangPolicy

    tokenizer = AutoTokenizer.from_pretrained(source.tokenizer_dir)
    if source.url is not None:
        sglang = SGLangPolicy(source.url, max_concurrency=concurrency)
        try:
            yield sglang, tokenizer
        finally:
            await sglang.close()
        return
    assert source.model_dir is not None  # _one_source: no url, so a model_dir
    model = AutoModelForCausalLM.from_pretrained(source.model_dir)
    yield HFPolicy(model, tokenizer.eos_token_id, seed=sampler_seed), tokenizer
