"""Wrapping slime's functions in place, for the data our hooks carry beside slime's own
(the teacher's top-k, `topk`; the tree of packed samples, `tree`).

Each extension wraps a function once per process under its own tag; several extensions
may wrap the same function (their wrappers chain). Before wrapping, an extension checks
that the calls it relies on are in slime's code as at the pinned commit
(tests/slime_cpu.py SLIME_COMMIT), so a newer slime fails with the reason, not silently.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from slime_ext.slime.settings import HookConfigError

_TAG = "__opd_extension__"
_ORIGINAL = "__opd_wraps__"


def wrap(
    module: Any,
    name: str,
    make: Callable[[Callable[..., Any]], Callable[..., Any]],
    tag: str,
    drifted: Callable[[str, str], str],
) -> None:
    """module.name = make(module.name), unless an extension tagged `tag` wrapped it."""
    wrap_in(vars(module), name, make, tag, lambda what: drifted(f"{module.__name__}.{name}", what))


def wrap_in(
    namespace: dict[str, Any],
    name: str,
    make: Callable[[Callable[..., Any]], Callable[..., Any]],
    tag: str,
    drifted: Callable[[str], str],
) -> None:
    """namespace[name] = make(namespace[name]) (a module's or a function's globals), unless
    an extension tagged `tag` wrapped it there."""
    current = namespace.get(name)
    if current is None or not callable(current):
        raise HookConfigError(drifted("is gone"))
    link = current
    while link is not None:
        if getattr(link, _TAG, None) == tag:
            return
        link = getattr(link, _ORIGINAL, None)
    wrapped = make(current)
    setattr(wrapped, _TAG, tag)
    setattr(wrapped, _ORIGINAL, current)
    namespace[name] = wrapped


def before(hook: Callable[[dict[str, Any]], None]) -> Callable[..., Any]:
    """A `make` for wrap: call hook(first argument) before the function."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def called(data: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            hook(data)
            return original(data, *args, **kwargs)

        return called

    return make


def logged_without(keys: Sequence[str]) -> Callable[..., Any]:
    """A `make` for wrap of slime's train-side log_rollout_data: our keys left out (slime
    logs the mean of every key of the rank's rollout data it does not know)."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def log_rollout_data(rollout_id: Any, args: Any, rollout_data: dict[str, Any]) -> Any:
            kept = {k: v for k, v in rollout_data.items() if k not in keys}
            return original(rollout_id, args, kept)

        return log_rollout_data

    return make


def require_source(
    function: Any, needles: Sequence[str], name: str, drifted: Callable[[str, str], str]
) -> None:
    """The calls a wrapper relies on are in slime's code."""
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError) as err:
        raise HookConfigError(drifted(name, f"has no readable source ({err})")) from err
    missing = [needle for needle in needles if needle not in source]
    if missing:
        raise HookConfigError(drifted(name, f"no longer contains {missing}"))


def before_rank_split(
    hook: Callable[[dict[str, Any]], None], tag: str, drifted: Callable[[str, str], str]
) -> None:
    """Call hook(rank's rollout data) in slime's DP split, once per rank, before slime
    tensorizes the rank's payload (RolloutManager._split_train_data_by_dp builds each
    rank's dict, with its "partition" and "tokens", and calls
    tensorize_rollout_data_for_training on it).

    In a job the RolloutManager is a Ray actor: Ray ships its class by value, so its
    methods read a copy of slime.ray.rollout's globals made when the actor started, and a
    wrapper put on the module alone is never called (the teacher's top-k and the trees
    would not reach training). The function is wrapped where the live manager's split
    reads it too: in those globals, found on the call stack (slime calls the rollout log
    hook, which installs this, from RolloutManager.generate)."""
    from slime.ray import rollout

    manager = rollout.RolloutManager
    split = getattr(manager, "__ray_metadata__", None)
    split_class = split.modified_class if split is not None else manager
    require_source(
        split_class._split_train_data_by_dp,
        ('"partition": partition', '"tokens"', "tensorize_rollout_data_for_training(rollout_data)"),
        "RolloutManager._split_train_data_by_dp",
        drifted,
    )
    name = "tensorize_rollout_data_for_training"
    wrap(rollout, name, before(hook), tag, drifted)
    live = _calling_manager_globals()
    if live is not None and live is not vars(rollout):
        where = f"{name} in the RolloutManager actor's copy of slime.ray.rollout"
        wrap_in(live, name, before(hook), tag, lambda what: drifted(where, what))


def _calling_manager_globals() -> dict[str, Any] | None:
    """The globals RolloutManager.generate runs with, that generate being on the call stack
    (in a Ray actor: the copy of slime.ray.rollout's globals that every method of the
    unpickled class shares), or None."""
    frame = inspect.currentframe()
    while frame is not None:
        owner = frame.f_locals.get("self") if frame.f_code.co_name == "generate" else None
        if hasattr(type(owner), "_split_train_data_by_dp"):
            return frame.f_globals
        frame = frame.f_back
    return None
