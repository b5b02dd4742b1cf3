"""Rendering conversations to token ids, and building per-turn trajectories from them.

One turn: the policy sees `context_ids` (the conversation so far, rendered once through
the tokenizer's chat template, with the generation prompt), samples `span_ids` (think then
action), the harness runs the action and appends the observation as a `role: tool`
message. `TrajectoryBuilder` records this without ever re-tokenizing sampled ids and checks
DESIGN.md invariant 1 at each new context: context_{k+1} must extend context_k token for
token and must contain the sampled action ids right after it. A failed check is recorded
as drift on the turn (and the turn keeps the part of its context the trunk lost), never
patched.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal

from rollout.toolcalls import (
    ToolCall,
    ToolCallError,
    ToolCallFormat,
    parse_tool_calls,
    render_tool_call,
)
from rollout.trajectory import (
    MaskTier,
    Task,
    Trajectory,
    TrajectoryStatus,
    Turn,
    TurnTimings,
)

Message = dict[str, Any]
ThinkPolicy = Literal["drop", "keep"]
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ChatRenderer:
    """A tokenizer's chat template with the harness's tools and think policy."""

    def __init__(
        self,
        tokenizer: Any,
        tools: Sequence[dict[str, Any]] | None = None,
        think_policy: ThinkPolicy = "drop",
        tool_call_format: ToolCallFormat = "hermes",
    ) -> None:
        if think_policy not in ("drop", "keep"):
            raise ValueError(f"think_policy must be 'drop' or 'keep', got {think_policy!r}")
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.think_policy = think_policy
        self.tool_call_format = tool_call_format
        self.eos_id: int = tokenizer.eos_token_id
        self.think_close_id: int | None = tokenizer.convert_tokens_to_ids(THINK_CLOSE)
        if self.think_close_id == tokenizer.unk_token_id:
            self.think_close_id = None

    def visible(self, messages: Sequence[Message]) -> list[Message]:
        """Messages as later contexts show them: without earlier think under `drop`."""
        if self.think_policy == "keep":
            return list(messages)
        return [_without_think(m) if m["role"] == "assistant" else m for m in messages]

    def render_ids(self, messages: Sequence[Message], add_generation_prompt: bool) -> list[int]:
        encoded = self.tokenizer.apply_chat_template(
            self.visible(messages),
            tools=self.tools,
            tokenize=True,
            add_generation_prompt=add_generation_prompt,
            preserve_thinking=self.think_policy == "keep",
            tool_call_format=self.tool_call_format,
        )
        ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        return [int(i) for i in ids]

    def context_ids(self, messages: Sequence[Message]) -> list[int]:
        """The ids the policy conditions on for its next turn."""
        return self.render_ids(messages, add_generation_prompt=True)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def think_len(self, span_ids: Sequence[int]) -> int:
        """Where the action starts: after </think> and the whitespace ids that follow it."""
        if self.think_close_id is None or self.think_close_id not in span_ids:
            return 0
        end = list(span_ids).index(self.think_close_id) + 1
        while end < len(span_ids) and not self.tokenizer.decode([span_ids[end]]).strip():
            end += 1
        return end

    def assistant_message(self, span_ids: Sequence[int], think_len: int) -> Message:
        """The sampled span as a message: its think as reasoning_content, its action text
        as content verbatim (so the template re-renders exactly what was sampled)."""
        think = self.tokenizer.decode(span_ids[:think_len])
        think = think.split(THINK_CLOSE)[0].split(THINK_OPEN)[-1].strip("\n")
        action = list(span_ids[think_len:])
        if action and action[-1] == self.eos_id:
            action = action[:-1]
        message: Message = {"role": "assistant", "content": self.tokenizer.decode(action)}
        if think_len:
            message["reasoning_content"] = think
        return message

    def scripted_span_ids(self, message: Message) -> list[int]:
        """The ids a model would sample to write `message` (for traces and tests)."""
        think = message.get("reasoning_content")
        text = f"{THINK_OPEN}\n{think}\n{THINK_CLOSE}\n\n" if think else ""
        content = message.get("content") or ""
        calls = [ToolCall(**c.get("function", c)) for c in message.get("tool_calls") or []]
        parts = [content] if content else []
        parts += [render_tool_call(call, self.tool_call_format) for call in calls]
        return [*self.encode(text + "\n".join(parts)), self.eos_id]


def _without_think(message: Message) -> Message:
    return {key: value for key, value in message.items() if key != "reasoning_content"}


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    limit = min(len(a), len(b))
    for index in range(limit):
        if a[index] != b[index]:
            return index
    return limit


class RecordedTurn:
    """What the harness needs after a turn is recorded: its action, parsed."""

    def __init__(
        self, index: int, message: Message, calls: list[ToolCall], error: ToolCallError | None
    ) -> None:
        self.index = index
        self.message = message
        self.calls = calls
        self.error = error


class TrajectoryBuilder:
    """Builds one Trajectory turn by turn; storage stays linear in its length.

    Use: `ids = builder.next_context()`, sample `span_ids` from it, `builder.record_turn(
    span_ids, ...)`, run the action, `builder.record_observation(text)`, repeat; then
    `builder.finish(status, reason)`.
    """

    def __init__(
        self,
        renderer: ChatRenderer,
        task: Task,
        messages: Sequence[Message],
        trajectory_id: str,
        sample_index: int = 0,
        max_calls_per_turn: int = 1,
    ) -> None:
        self.renderer = renderer
        self.task = task
        self.messages: list[Message] = list(messages)
        self.trajectory_id = trajectory_id
        self.sample_index = sample_index
        self.max_calls_per_turn = max_calls_per_turn
        self.turns: list[Turn] = []
        self._latest_context: list[int] | None = None
        self._context_is_fresh = False
        self._started = time.perf_counter()

    def next_context(self) -> list[int]:
        """Render the context of the next turn and check it against the previous one."""
        context = self.renderer.context_ids(self.messages)
        if self.turns and self._latest_context is not None:
            self._check_extension(self._latest_context, context)
        self._latest_context = context
        self._context_is_fresh = True
        return context

    def record_turn(
        self,
        span_ids: Sequence[int],
        logprobs: Sequence[float] | None = None,
        finish_reason: str | None = None,
        model_s: float = 0.0,
    ) -> RecordedTurn:
        """Record the span sampled after the latest `next_context()`, and parse its action."""
        if not self._context_is_fresh or self._latest_context is None:
            raise RuntimeError("record_turn needs a fresh next_context() first")
        self._context_is_fresh = False
        think_len = self.renderer.think_len(span_ids)
        message = self.renderer.assistant_message(span_ids, think_len)
        calls: list[ToolCall] = []
        error: ToolCallError | None = None
        try:
            calls = parse_tool_calls(
                message["content"],
                self.renderer.tool_call_format,
                self.renderer.tools,
                self.max_calls_per_turn,
            )
        except ToolCallError as err:
            error = err
        self.messages.append(message)
        self.turns.append(
            Turn(
                context_len=len(self._latest_context),
                span_ids=list(span_ids),
                think_len=think_len,
                logprobs=list(logprobs) if logprobs is not None else None,
                mask_tier=MaskTier.INVALID_ACTION if error else MaskTier.VALID,
                finish_reason=finish_reason,
                timings=TurnTimings(model_s=model_s),
            )
        )
        return RecordedTurn(len(self.turns) - 1, message, calls, error)

    def turn_context_ids(self, index: int) -> list[int]:
        """The context turn `index` was sampled after (valid at any point of the build)."""
        turn = self.turns[index]
        assert self._latest_context is not None
        return self._latest_context[: turn.context_len] + turn.context_suffix_ids

    def set_tier(self, index: int, tier: MaskTier) -> None:
        """Override a turn's tier: the harness knows, e.g., that a final answer without a
        tool call is a valid last action, or that a command failed at the shell (tier 2)."""
        self.turns[index].mask_tier = tier

    def record_observation(
        self, text: str, tier: MaskTier | None = None, sandbox_s: float = 0.0
    ) -> None:
        """The latest turn's observation (a `role: tool` message), and its tier if the
        command's outcome decides it (tier 2)."""
        turn = self.turns[-1]
        self.messages.append({"role": "tool", "content": text})
        turn.observation_ids = self.renderer.encode(text)
        turn.timings.sandbox_s += sandbox_s
        if tier is not None and turn.mask_tier is MaskTier.VALID:
            turn.mask_tier = tier

    def finish(
        self,
        status: TrajectoryStatus,
        reason: str,
        reward: float | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Trajectory:
        trunk = self._latest_context or self.renderer.context_ids(self.messages)
        return Trajectory(
            trajectory_id=self.trajectory_id,
            task=self.task,
            sample_index=self.sample_index,
            think_policy=self.renderer.think_policy,
            trunk_ids=trunk,
            turns=self.turns,
            status=status,
            status_reason=reason,
            reward=reward,
            metadata=metadata or {},
            wall_s=time.perf_counter() - self._started,
        )

    def _check_extension(self, previous: list[int], context: list[int]) -> None:
        last = self.turns[-1]
        shared = common_prefix_len(previous, context)
        if shared < len(previous):
            _mark_drift(
                last,
                f"context_{len(self.turns)} does not extend this turn's context "
                f"(they diverge at id {shared} of {len(previous)})",
            )
            # Every turn whose context reached past the shared prefix keeps the lost part.
            for turn in self.turns:
                if turn.context_len > shared:
                    turn.context_suffix_ids = (
                        previous[shared : turn.context_len] + turn.context_suffix_ids
                    )
                    turn.context_len = shared
                    _mark_drift(
                        turn,
                        f"a later context rewrote this turn's context (it diverges at id {shared})",
                    )
            return
        sampled = last.span_ids if self.renderer.think_policy == "keep" else last.action_ids
        rendered = context[len(previous) : len(previous) + len(sampled)]
        if rendered != sampled:
            at = common_prefix_len(rendered, sampled)
            _mark_drift(
                last,
                "the next context re-tokenized the sampled "
                f"{'span' if self.renderer.think_policy == 'keep' else 'action'}"
                f" (first difference at id {at} of {len(sampled)})",
            )


def _mark_drift(turn: Turn, reason: str) -> None:
    if not turn.drift:
        turn.drift, turn.drift_reason = True, reason


def trajectory_from_conversation(
    renderer: ChatRenderer,
    task: Task,
    messages: Sequence[Message],
    trajectory_id: str,
    spans: Sequence[Sequence[int]] | None = None,
    status: TrajectoryStatus = TrajectoryStatus.COMPLETED,
    reason: str = "scripted",
    reward: float | None = None,
) -> Trajectory:
    """A trajectory from a finished conversation: each assistant message is a turn whose
    sampled ids are `spans[k]` (or, for scripted conversations, the ids a model would
    sample to write the message); tool messages are observations."""
    num_turns = sum(1 for m in messages if m["role"] == "assistant")
    if spans is not None and len(spans) != num_turns:
        raise ValueError(f"{len(spans)} spans for {num_turns} assistant messages")
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    builder = TrajectoryBuilder(renderer, task, messages[:first], trajectory_id)
    turn_index = 0
    for message in messages[first:]:
        if message["role"] == "assistant":
            builder.next_context()
            span = spans[turn_index] if spans is not None else renderer.scripted_span_ids(message)
            builder.record_turn(span)
            turn_index += 1
        elif message["role"] == "tool":
            builder.record_observation(message["content"])
        else:
            builder.messages.append(dict(message))
    return builder.finish(status, reason, reward)
