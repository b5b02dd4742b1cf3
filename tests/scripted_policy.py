"""A scripted policy for evaluation tests: each trajectory replays a list of assistant
messages chosen by its task (and sample), through the real chat template, tool-call
parser and harness. It stands in for a model, whose outputs a test cannot choose."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

from rollout.chat import ChatRenderer, Message
from rollout.policy import Generation, Policy, PolicyError, SamplingParams
from rollout.toolcalls import ToolCall

HANG = "hang"
"""A script that never answers (the trajectory deadline ends it)."""
FAIL = "fail"
"""A script whose first generation fails like an unreachable server (an infrastructure abort)."""

Script = list[Message] | str
ScriptFor = Callable[[str, int], Script]
"""(task_id, sample) -> the messages to replay, HANG or FAIL."""


def tool(name: str, **arguments: Any) -> Message:
    call = ToolCall(name=name, arguments=arguments)
    return {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]}


def say(text: str) -> Message:
    return {"role": "assistant", "content": text}


class ScriptedPolicy:
    def __init__(self, tokenizer: Any, script_for: ScriptFor) -> None:
        self.renderer = ChatRenderer(tokenizer, [])
        self.script_for = script_for
        self.turns: Counter[str] = Counter()
        """Generations asked for, per trajectory id (task_id#sample)."""

    async def generate(
        self, input_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Generation:
        assert session_id is not None
        task_id, _, sample = session_id.rpartition("#")
        script = self.script_for(task_id, int(sample))
        turn = self.turns[session_id]
        self.turns[session_id] += 1
        if script == HANG:
            await asyncio.sleep(3600)
        if script == FAIL or isinstance(script, str):
            raise PolicyError("scripted: the server is unreachable")
        ids = self.renderer.scripted_span_ids(script[min(turn, len(script) - 1)])
        return Generation(output_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop")


def scripted_factory(
    tokenizer: Any, script_for: ScriptFor, policies: list[ScriptedPolicy] | None = None
) -> Callable[[], contextlib.AbstractAsyncContextManager[tuple[Policy, Any]]]:
    """A `policy_factory` for launch.evaluation.run_evaluation; `policies` collects the
    policies it made (to count their generations)."""

    @contextlib.asynccontextmanager
    async def factory() -> AsyncIterator[tuple[Policy, Any]]:
        policy = ScriptedPolicy(tokenizer, script_for)
        if policies is not None:
            policies.append(policy)
        yield policy, tokenizer

    return factory
