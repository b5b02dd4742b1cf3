"""Where an evaluation's or a sampling run's generations come from: `--policy` (an SGLang
server URL, a local HF directory, factory:<preset>, bundled:student) and `--tokenizer`;
for SWE evaluations also a scripted agent, no model: gold (the dataset's fix), empty (an
unchanged repository) or replay:FILE (rollout.harness.swe_scripts)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, model_validator

from rollout.chat import ChatRenderer, Message
from rollout.policy import Policy
from rollout.toolcalls import ToolCallFormat
from rollout.trajectory import Task

URL_PREFIXES = ("http://", "https://")
SCRIPTED_POLICIES = ("gold", "empty")
REPLAY_PREFIX = "replay:"


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
    from slime_ext.models.refs import resolve_model

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
        sglang = SGLangPolicy(source.url, max_concurrency=concurrency, seed=sampler_seed)
        try:
            yield sglang, tokenizer
        finally:
            await sglang.close()
        return
    assert source.model_dir is not None  # _one_source: no url, so a model_dir
    model = AutoModelForCausalLM.from_pretrained(source.model_dir)
    yield HFPolicy(model, tokenizer.eos_token_id, seed=sampler_seed), tokenizer


def is_scripted(spec: str) -> bool:
    """Whether --policy names a scripted SWE agent (gold, empty, replay:FILE)."""
    return spec in SCRIPTED_POLICIES or spec.startswith(REPLAY_PREFIX)


def replay_path(spec: str) -> Path | None:
    """The file of `replay:FILE` (None for other policies)."""
    if not spec.startswith(REPLAY_PREFIX):
        return None
    path = spec.removeprefix(REPLAY_PREFIX)
    if not path:
        raise PolicySpecError("--policy replay:FILE needs the file (a JSONL of actions)")
    return Path(path)


def scripted_policy_factory(
    spec: str,
    tasks: Iterable[Task],
    reference_patch: Callable[[Task], str],
    tokenizer_spec: str | None,
    models_dir: Path,
    seed: int,
    tool_call_format: ToolCallFormat,
) -> Callable[[], contextlib.AbstractAsyncContextManager[tuple[Policy, Any]]]:
    """Opens (ScriptedSWEPolicy, tokenizer) for `spec`; the scripts are made (a replay
    file read) here, before anything runs. The tokenizer: --tokenizer's, or the factory's
    (its ids never reach a model; any tokenizer with a chat template works)."""
    from rollout.harness.swe_scripts import (
        ScriptedSWEPolicy,
        gold_scripts,
        load_replay,
        submit,
    )

    unscripted: dict[str, str] = {}
    scripts: dict[str, list[Message]]
    if spec == "gold":
        scripts, unscripted = gold_scripts(tasks, reference_patch)
    elif spec == "empty":
        scripts = {task.task_id: [submit()] for task in tasks}
    else:
        path = replay_path(spec)
        if path is None:
            raise PolicySpecError(f"--policy {spec!r} is not a scripted policy")
        scripts = load_replay(path)
        unscripted = dict.fromkeys(
            (task.task_id for task in tasks if task.task_id not in scripts),
            f"{path} has no line for this instance",
        )
    name = spec.partition(":")[0]

    @contextlib.asynccontextmanager
    async def factory() -> AsyncIterator[tuple[Policy, Any]]:
        tokenizer = _scripted_tokenizer(tokenizer_spec, models_dir, seed)
        renderer = ChatRenderer(tokenizer, tool_call_format=tool_call_format)
        yield ScriptedSWEPolicy(name, renderer, scripts, unscripted), tokenizer

    return factory


def _scripted_tokenizer(tokenizer_spec: str | None, models_dir: Path, seed: int) -> Any:
    if tokenizer_spec is None:
        from slime_ext.models.factory import build_tokenizer

        return build_tokenizer()
    from transformers import AutoTokenizer

    from slime_ext.models.refs import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(tokenizer_spec, models_dir, seed))
