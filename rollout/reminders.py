"""Reminders for OPRD: the teacher is a frozen snapshot of the student that reads
training-only reminders the student never sees (DESIGN.md; ../shared/seeds/oprd-notes.txt).

Scopes. A global reminder, once raised (by the task, or by an observation), stays in every
later teacher context. A local reminder raised by observation k is shown only when the
teacher scores action k+1, then removed. The teacher's context for turn k is the student's
context_k, token for token, with one extra user message carrying the active reminders
inserted right before the generation prompt; the span it scores is the student's own
(invariant 2). Reminders are never written into the student's history.

Sources are pluggable (`ReminderSource`): the default reads rules from a YAML file (errors,
failing tests, repeated actions, invalid actions; task-level global reminders by task
kind); a job may name its own class by dotted path.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Literal, Protocol

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollout.chat import ChatRenderer, Message, common_prefix_len
from rollout.runner import TeacherContext
from rollout.trajectory import MaskTier, Task, Trajectory, Turn

ReminderScope = Literal["global", "local"]

PROBE: list[Message] = [
    {"role": "system", "content": "."},
    {"role": "user", "content": "."},
    {"role": "assistant", "content": "."},
    {"role": "tool", "content": "."},
]
"""A conversation ending in an observation: the reminder message is rendered after it once,
and its ids are spliced into any context (ChatML-style templates render a message alone)."""


class ReminderPlacementError(ValueError):
    """The chat template gives the reminder message no place in the teacher's context."""


@dataclass(frozen=True)
class Reminder:
    text: str
    scope: ReminderScope


@dataclass(frozen=True)
class Step:
    """An earlier turn as a reminder source reads it."""

    action: str
    observation: str
    tier: MaskTier = MaskTier.VALID


class ReminderSource(Protocol):
    def reminders(self, task: Task, steps: Sequence[Step]) -> list[Reminder]:
        """With no steps: the task's own reminders, before the first action (global ones).
        Otherwise: the reminders that the last step's observation raises."""
        ...


class ReminderRule(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    when: Literal["pattern", "repeated_action", "invalid_action"]
    """pattern: `pattern` found in the observation; repeated_action: the action repeats an
    earlier one; invalid_action: a tier-1/2 turn."""
    scope: ReminderScope = "local"
    text: str
    """str.format template: {match} (pattern), {action} (repeated_action)."""
    pattern: str | None = None

    @model_validator(mode="after")
    def _pattern_compiles(self) -> ReminderRule:
        if (self.when == "pattern") != (self.pattern is not None):
            raise ValueError(f"rule {self.name!r}: `pattern` goes with when: pattern, only")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as err:
                raise ValueError(f"rule {self.name!r}: bad pattern: {err}") from err
        return self


class ReminderFile(BaseModel):
    """What a reminders YAML holds (the packaged one: rollout/reminders.yaml)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    insert: str
    """The teacher-only user message; {items} is the reminders, one `item` each."""
    item: str = "- {text}"
    max_chars: int = Field(default=160, ge=16)
    """Longest quoted match or action in a rule's text."""
    global_reminders: dict[str, list[str]] = Field(default_factory=dict, alias="global")
    """Task-level global reminders by task kind; "all" applies to every kind."""
    rules: list[ReminderRule] = Field(default_factory=list)


def read_reminder_file(path: Path | None = None) -> ReminderFile:
    """The reminders in `path`, or the packaged rollout/reminders.yaml."""
    source = path or resources.files("rollout").joinpath("reminders.yaml")
    try:
        data = yaml.safe_load(source.read_text("utf-8"))
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"reminders file {source}: {err}") from err
    return ReminderFile.model_validate(data)


def _clip(text: str, limit: int) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


class RuleReminders:
    """Rule-based reminders: the file's global ones for the task's kind (and the task's
    metadata["reminders"]), then per observation whatever rules fire."""

    def __init__(self, spec: ReminderFile | None = None) -> None:
        self.spec = spec or read_reminder_file()
        self.patterns = {
            rule.name: re.compile(rule.pattern) for rule in self.spec.rules if rule.pattern
        }

    def reminders(self, task: Task, steps: Sequence[Step]) -> list[Reminder]:
        if not steps:
            texts = [
                *self.spec.global_reminders.get("all", []),
                *self.spec.global_reminders.get(task.kind, []),
                *(str(text) for text in task.metadata.get("reminders", [])),
            ]
            return [Reminder(text, "global") for text in texts]
        last, limit = steps[-1], self.spec.max_chars
        found = []
        for rule in self.spec.rules:
            if rule.when == "invalid_action" and last.tier is not MaskTier.VALID:
                found.append(Reminder(rule.text.format(), rule.scope))
            elif rule.when == "repeated_action":
                action = " ".join(last.action.split())
                if action and any(" ".join(s.action.split()) == action for s in steps[:-1]):
                    found.append(
                        Reminder(rule.text.format(action=_clip(action, limit)), rule.scope)
                    )
            elif rule.when == "pattern":
                matches = self.patterns[rule.name].findall(last.observation)
                if matches:
                    text = rule.text.format(match=_clip(str(matches[-1]), limit))
                    found.append(Reminder(text, rule.scope))
        return found


def reminder_source(kind: str, path: Path | None = None) -> ReminderSource | None:
    """The source a job's teacher.reminders names: rules (from `path` or the packaged
    file), none (the control: the teacher reads the student's context), or a dotted path
    `package.module.Class` constructed with no arguments."""
    if kind == "none":
        return None
    if kind == "rules":
        return RuleReminders(read_reminder_file(path))
    module_name, _, name = kind.rpartition(".")
    if not module_name:
        raise ValueError(f"reminders {kind!r}: use rules, none, or package.module.Class")
    try:
        source_class = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"reminders {kind!r}: cannot load it ({err})") from err
    source: ReminderSource = source_class()
    return source


@dataclass
class ReminderStats:
    """Teacher contexts built, global reminders raised, local reminders shown: sums, so the
    counts of several views (one per trajectory on slime) add up to a step's."""

    contexts: int = 0
    with_reminders: int = 0
    global_count: int = 0
    global_tokens: int = 0
    local_count: int = 0
    local_tokens: int = 0
    block_tokens: int = 0

    def add(self, other: ReminderStats) -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)

    def metrics(self) -> dict[str, float]:
        return {
            "rollout/reminder_global_count": float(self.global_count),
            "rollout/reminder_local_count": float(self.local_count),
            "rollout/reminder_global_tokens": self.global_tokens / max(self.global_count, 1),
            "rollout/reminder_local_tokens": self.local_tokens / max(self.local_count, 1),
            "rollout/reminder_context_frac": self.with_reminders / max(self.contexts, 1),
            "rollout/reminder_tokens_per_context": self.block_tokens / max(self.contexts, 1),
        }

    def take(self) -> dict[str, float]:
        """The metrics since the last take; the counts start again from zero."""
        metrics = self.metrics()
        for name, value in asdict(ReminderStats()).items():
            setattr(self, name, value)
        return metrics


@dataclass(frozen=True)
class ActiveReminders:
    """What the teacher reads before one action."""

    global_texts: list[str]
    """Every global reminder raised so far, in the order raised."""
    local_texts: list[str]
    """The local reminders of the previous observation."""
    raised: list[str]
    """The global reminders this context is the first to show."""


class ReminderTeacherContext:
    """The runner's teacher_context for OPRD: context_k with the reminders active at turn k
    (every global one raised so far, and the local ones of observation k-1) in a user
    message before the generation prompt. Deterministic in (task, context, earlier turns),
    so the trainer can rebuild any teacher context from a stored trajectory."""

    def __init__(
        self,
        renderer: ChatRenderer,
        source: ReminderSource | None,
        spec: ReminderFile | None = None,
        cache_size: int = 65_536,
    ) -> None:
        self.renderer = renderer
        self.source = source
        self.spec = spec or read_reminder_file()
        self.stats = ReminderStats()
        self.cache_size = cache_size
        self._raised: OrderedDict[tuple[str, int, int], list[Reminder]] = OrderedDict()
        self.probe_ids = renderer.render_ids(PROBE, add_generation_prompt=False)
        self.generation_prompt = renderer.render_ids(PROBE, add_generation_prompt=True)[
            len(self.probe_ids) :
        ]

    def active(self, task: Task, earlier_turns: Sequence[Turn]) -> ActiveReminders:
        """The reminders the teacher reads before action len(earlier_turns)."""
        if self.source is None:
            return ActiveReminders([], [], [])
        steps = tuple(self._step(turn) for turn in earlier_turns)
        global_texts = [r.text for r in self._reminders(task, ()) if r.scope == "global"]
        raised = list(global_texts) if not steps else []
        local: list[str] = []
        for j in range(len(steps)):
            last = j == len(steps) - 1
            for reminder in self._reminders(task, steps[: j + 1]):
                if reminder.scope == "global" and reminder.text not in global_texts:
                    global_texts.append(reminder.text)
                    raised += [reminder.text] if last else []
                elif reminder.scope == "local" and last and reminder.text not in local:
                    local.append(reminder.text)
        return ActiveReminders(global_texts, local, raised)

    def __call__(
        self, task: Task, context_ids: list[int], earlier_turns: Sequence[Turn] = ()
    ) -> list[int]:
        return self.view(task, context_ids, earlier_turns, self.stats)

    def counting(self, stats: ReminderStats) -> TeacherContext:
        """This teacher context counting into `stats` instead of `self.stats`: on slime the
        generate hook scores many trajectories at once and gives each its own counts."""
        return functools.partial(self.view, stats=stats)

    def view(
        self,
        task: Task,
        context_ids: list[int],
        earlier_turns: Sequence[Turn],
        stats: ReminderStats,
    ) -> list[int]:
        """The teacher's context for turn len(earlier_turns), counted into `stats`."""
        active = self.active(task, earlier_turns)
        stats.contexts += 1
        texts = [*active.global_texts, *active.local_texts]
        if not texts:
            return context_ids
        cut = len(context_ids) - len(self.generation_prompt)
        if cut < 0 or context_ids[cut:] != self.generation_prompt:
            raise ReminderPlacementError(
                "the student's context does not end with the template's generation prompt: "
                "the reminder message has no place before it"
            )
        block = self.block_ids(texts)
        stats.with_reminders += 1
        stats.block_tokens += len(block)
        stats.global_count += len(active.raised)
        stats.global_tokens += sum(len(self.renderer.encode(t)) for t in active.raised)
        stats.local_count += len(active.local_texts)
        stats.local_tokens += sum(len(self.renderer.encode(t)) for t in active.local_texts)
        return context_ids[:cut] + block + context_ids[cut:]

    def block_ids(self, texts: Sequence[str]) -> list[int]:
        """The ids of the reminder message as the template renders it after an observation."""
        items = "\n".join(self.spec.item.format(text=text) for text in texts)
        message: Message = {"role": "user", "content": self.spec.insert.format(items=items)}
        before = self.probe_ids
        after = self.renderer.render_ids([*PROBE, message], add_generation_prompt=False)
        if after[: len(before)] != before:
            raise ReminderPlacementError(
                "the chat template re-renders earlier messages when a user message follows "
                "an observation: the reminder cannot be spliced into the student's context"
            )
        return after[len(before) :]

    def _step(self, turn: Turn) -> Step:
        decode = self.renderer.tokenizer.decode
        return Step(
            action=decode(turn.action_ids, skip_special_tokens=True),
            observation=decode(turn.observation_ids, skip_special_tokens=True),
            tier=turn.mask_tier,
        )

    def _reminders(self, task: Task, steps: tuple[Step, ...]) -> list[Reminder]:
        # each teacher context replays every earlier observation: raise each once (keyed
        # by a hash, so the cache holds no observation text)
        assert self.source is not None
        key = (task.task_id, len(steps), hash(steps))
        if key in self._raised:
            self._raised.move_to_end(key)
            return self._raised[key]
        found = self.source.reminders(task, steps)
        self._raised[key] = found
        if len(self._raised) > self.cache_size:
            self._raised.popitem(last=False)
        return found


def teacher_view(trajectory: Trajectory, teacher_context: TeacherContext) -> Trajectory:
    """The trajectory as the teacher scores it, for batching (`slime_ext.turns`): the same
    trunk and spans, each turn's context the teacher's (the trunk prefix it shares, then its
    own ids as the turn's context suffix). A view, not validated: teacher contexts need not
    grow from turn to turn (a local reminder leaves)."""
    turns = []
    for k, turn in enumerate(trajectory.turns):
        context = teacher_context(trajectory.task, trajectory.context_ids(k), trajectory.turns[:k])
        shared = min(common_prefix_len(context, trajectory.trunk_ids), turn.context_len)
        turns.append(
            turn.model_copy(update={"context_len": shared, "context_suffix_ids": context[shared:]})
        )
    return trajectory.model_copy(update={"turns": turns})
