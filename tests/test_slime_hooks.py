"""Contract tests of the slime hooks, run by slime's own code (the pinned commit installed
by `make slime`, its CPU import stand-ins in tests/slime_cpu.py): slime's Sample,
generate_and_rm_group (with our generate and reward hooks against the SGLang stand-in and a
real teacher service), the rollout-id contract, the train-data conversion, CP slicing and
the advantage computation. The loss through slime's whole data path is in
tests/test_slime_real.py.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout.chat import ChatRenderer
from rollout.harness.tir import TIRHarness
from rollout.runner import Runner, RunnerConfig
from rollout.tasks.arithmetic import make_tasks
from rollout.trajectory import MaskTier, Trajectory, TrajectoryStatus
from slime_ext.cpu_runtime.sglang_http import create_standin
from slime_ext.job.config import config_from_dict
from slime_ext.models.factory import build_checkpoint, build_model
from slime_ext.sft_data import read_records, turn_records, write_records
from slime_ext.slime import generate as generate_module
from slime_ext.slime import metrics as hook_metrics
from slime_ext.slime.generate import loss_kind
from slime_ext.slime.reward import post_process_rewards, reward
from slime_ext.slime.samples import METADATA_KEY, to_samples
from slime_ext.slime.settings import HookConfigError, config_path
from slime_ext.slime.sft_rollout import SFTDataError, generate_rollout
from teacher_server.app import create_app
from teacher_server.hf_backend import HFBackend
from teacher_server.metrics import ServerMetrics
from tests.live_server import serve_in_thread
from tests.slime_driver import require_slime, rollout_manager, slime_args
from tests.test_runner import REPLIES, TASKS, ScriptedPolicy

require_slime()

from slime.observability.rollout_data_utils import validate_rollout_id_annotated  # noqa: E402
from slime.rollout.sglang_rollout import GenerateState, generate_and_rm_group  # noqa: E402
from slime.utils.types import Sample  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


_JOB_DIRS: list[Path] = []
"""Where _args writes its job files: the module's pytest temp directory (set below)."""


@pytest.fixture(scope="module", autouse=True)
def _job_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    _JOB_DIRS.append(tmp_path_factory.mktemp("jobs"))
    yield
    _JOB_DIRS.clear()


def _args(job: dict[str, Any] | None = None, *, under: Path | None = None, **overrides: Any) -> Any:
    """slime's arguments for a job (by default the embedded default's), as `opd launch`
    writes them and slime's parser reads them, with `overrides` set. The job files go
    under `under`, by default this module's temp directory (other modules pass theirs)."""
    directory = Path(tempfile.mkdtemp(prefix="opd-slime-", dir=under or _JOB_DIRS[-1]))
    args = slime_args(config_from_dict(job or {}), directory)
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def _train_data(args: Any, samples: list[Any]) -> dict[str, Any]:
    """slime's RolloutManager._convert_samples_to_train_data (our reward post-process)."""
    return rollout_manager(args, [])._convert_samples_to_train_data(samples)


def _scripted(factory_tokenizer: Any, think_policy: str = "drop") -> list[Trajectory]:
    harness = TIRHarness()
    renderer = ChatRenderer(factory_tokenizer, harness.tools, think_policy=think_policy)  # type: ignore[arg-type]
    runner = Runner(harness, ScriptedPolicy(renderer, REPLIES), renderer, RunnerConfig())
    trajectories = asyncio.run(runner.run(TASKS))
    for trajectory in trajectories:  # as if a teacher had scored every span
        for turn in trajectory.turns:
            turn.teacher_logprobs = [-1.0 - 0.01 * i for i in range(len(turn.span_ids))]
    return trajectories


def _base(index: int, group: int = 0) -> Sample:
    return Sample(index=index, group_index=group, prompt="p", metadata={"source": "x"})


def _task_sample(index: int) -> Sample:
    """slime's sample of an arithmetic training task, the task in its metadata."""
    task = make_tasks(1, "train", seed=3)[0]
    return Sample(
        index=index, group_index=0, prompt=task.prompt, metadata={"task": task.model_dump()}
    )


@dataclass(frozen=True)
class _ServedHook:
    """slime's arguments for the generate hook while its router and teacher serve."""

    args: Any
    router: str
    tokenizer_dir: Path

    def generate(
        self, base: Sample, sampling_params: dict[str, Any] | None = None
    ) -> tuple[Any, generate_module.HookState]:
        """slime's generate_and_rm_group (one sample's group) through our generate and
        reward hooks, and the state the hook kept."""

        async def rollout() -> tuple[Any, generate_module.HookState]:
            GenerateState.clear_instances()  # slime's per-process state, made in this loop
            [samples] = await generate_and_rm_group(self.args, [base], sampling_params or {})
            loop = id(asyncio.get_running_loop())
            key = (config_path(self.args), self.router, str(self.tokenizer_dir), loop)
            return samples, generate_module._state(*key)

        return asyncio.run(rollout())


@contextmanager
def _served_hook(
    backend: HFBackend,
    tokenizer_dir: Path,
    job_dir: Path,
    *,
    teacher: dict[str, Any],
    algorithm: dict[str, Any] | None = None,
    max_turns: int = 2,
    max_new_tokens: int = 8,
    student: torch.nn.Module | None = None,
) -> Iterator[_ServedHook]:
    """`student` (by default the teacher's own model: a self-teacher's snapshot) behind an
    SGLang router stand-in, `backend` as the teacher app, and a TIR job with the `teacher`
    and `algorithm` sections (the teacher's url added) as the hook's job config."""
    policy_model = backend.scorer.model if student is None else student
    with (
        serve_in_thread(create_standin(policy_model, context_length=4096)) as router,
        serve_in_thread(create_app(backend, backend.scorer.metrics)) as teacher_url,
    ):
        config = {
            "model": {"tokenizer": str(tokenizer_dir)},
            "rollout": {"harness": "tir", "max_turns": max_turns, "max_new_tokens": max_new_tokens},
            "teacher": {**teacher, "url": teacher_url},
            "algorithm": algorithm or {},
        }
        host, port = router.removeprefix("http://").split(":")
        args = _args(
            config,
            under=job_dir,
            sglang_router_ip=host,
            sglang_router_port=int(port),
            hf_checkpoint=str(tokenizer_dir),
            rollout_num_gpus=1,  # one engine behind the router (slime's semaphore)
        )
        yield _ServedHook(args, router, tokenizer_dir)


@pytest.mark.parametrize("status", list(TrajectoryStatus))
def test_both_modes_train_a_trajectory_by_one_rule(factory_tokenizer: Any, status: Any) -> None:
    """The local trainer trains exactly the trajectories slime gets real samples of: an
    aborted, sandbox_error or teacher_error one is a placeholder there and left out here."""
    from types import SimpleNamespace

    from slime_ext.local.loop import LocalRun

    [trajectory, *_] = _scripted(factory_tokenizer)
    trajectory.status, trajectory.status_reason = status, f"ended: {status.value}"
    on_slime = [
        not sample.metadata[METADATA_KEY].get("placeholder", False)
        for sample in to_samples(trajectory, _base(1), "kl")
    ]
    run = SimpleNamespace(job=config_from_dict({}))
    for recipe in ("opd", "rl", "sft"):
        local = LocalRun._trainable(run, [trajectory], recipe)  # type: ignore[arg-type]
        assert bool(local) == all(on_slime) == trajectory.ended_normally, recipe
    normal = status in (TrajectoryStatus.COMPLETED, TrajectoryStatus.TRUNCATED)
    assert trajectory.ended_normally == normal


def test_per_turn_samples_are_context_plus_span_with_tier_masks(factory_tokenizer: Any) -> None:
    [mul, half, _] = _scripted(factory_tokenizer)
    assert half.turns[0].mask_tier is MaskTier.INVALID_ACTION  # no tool call
    for trajectory, index in ((mul, 4), (half, 5)):
        kl = to_samples(trajectory, _base(index), "kl")
        sft = to_samples(trajectory, _base(index), "imitation", with_teacher=False)
        assert len(kl) == trajectory.num_turns
        for k, (sample, turn) in enumerate(zip(kl, trajectory.turns, strict=True)):
            assert sample.tokens == trajectory.context_ids(k) + turn.span_ids
            assert sample.response_length == len(turn.span_ids)
            assert sample.rollout_log_probs == turn.logprobs
            assert sample.teacher_log_probs == turn.teacher_logprobs
            assert sample.loss_mask == [1] * len(turn.span_ids)  # KL trains on tier 1
            assert sample.rollout_id == index and sample.reward == trajectory.reward
            assert sample.metadata["source"] == "x"  # slime's own metadata is kept
            assert sample.metadata[METADATA_KEY]["turn"] == k
            invalid = turn.mask_tier is not MaskTier.VALID
            assert sft[k].loss_mask == [int(not invalid)] * len(turn.span_ids)
            assert sft[k].teacher_log_probs is None
    validate_rollout_id_annotated([[to_samples(mul, _base(4), "kl")]])


def test_keep_policy_gives_one_sequence_with_observations_masked(factory_tokenizer: Any) -> None:
    trajectory = _scripted(factory_tokenizer, think_policy="keep")[0]
    assert trajectory.think_policy == "keep" and trajectory.num_turns == 3
    [sample] = to_samples(trajectory, _base(1), "kl")
    prompt = len(trajectory.context_ids(0))
    assert len(sample.tokens) - sample.response_length == prompt
    on_span = [0] * sample.response_length
    for k, turn in enumerate(trajectory.turns):
        start = len(trajectory.context_ids(k))
        assert sample.tokens[start : start + len(turn.span_ids)] == turn.span_ids
        for i in range(len(turn.span_ids)):
            on_span[start - prompt + i] = 1
            assert sample.rollout_log_probs[start - prompt + i] == turn.logprobs[i]  # type: ignore[index]
            assert sample.teacher_log_probs[start - prompt + i] == turn.teacher_logprobs[i]  # type: ignore[index]
    assert sample.loss_mask == on_span  # observations and template tokens carry no loss
    assert 0 < sum(on_span) < sample.response_length
    for i, carries in enumerate(on_span):
        if not carries:
            assert sample.rollout_log_probs[i] == 0.0 == sample.teacher_log_probs[i]


def test_aborted_trajectories_become_removable_placeholders(factory_tokenizer: Any) -> None:
    [good, _, other] = _scripted(factory_tokenizer)
    aborted = other.model_copy(
        update={"status": TrajectoryStatus.SANDBOX_ERROR, "status_reason": "SandboxDiedError: x"}
    )
    [placeholder] = to_samples(aborted, _base(7), "kl")
    assert placeholder.remove_sample and placeholder.status is Sample.Status.ABORTED
    assert placeholder.response_length == 1 and placeholder.loss_mask == [0]
    assert placeholder.teacher_log_probs == [0.0] and placeholder.rollout_log_probs == [0.0]
    assert placeholder.metadata[METADATA_KEY]["abort_reason"] == "SandboxDiedError: x"
    assert placeholder.reward is not None  # slime computes no reward for aborted samples
    # a placeholder first: slime still copies every sample's teacher log-probs
    samples = [placeholder, *to_samples(good, _base(8), "kl")]
    data = _train_data(_args(), samples)
    assert len(data["teacher_log_probs"]) == len(samples)
    assert data["loss_masks"][0] == [0]
    assert data["rollout_mask_sums"][1] == good.span_token_count()
    unscored = good.model_copy(deep=True)
    unscored.turns[1].teacher_logprobs = None
    [refused] = to_samples(unscored, _base(9), "kl")
    assert refused.remove_sample and "teacher" in refused.metadata[METADATA_KEY]["abort_reason"]


def test_reward_hook_accepts_a_sample_or_a_list(factory_tokenizer: Any) -> None:
    [mul, _, wrong] = _scripted(factory_tokenizer)
    samples = to_samples(mul, _base(1), "kl") + to_samples(wrong, _base(2), "kl")
    args = _args()
    assert asyncio.run(reward(args, samples[0])) == 1.0
    expected = [1.0] * mul.num_turns + [0.0] * wrong.num_turns
    assert asyncio.run(reward(args, samples)) == expected


def test_reward_post_process_normalizes_one_reward_per_trajectory_in_its_group() -> None:
    def segments(rollout_id: int, group: int, count: int, value: float, removed: bool = False):  # type: ignore[no-untyped-def]
        return [
            Sample(
                index=rollout_id,
                group_index=group,
                rollout_id=rollout_id,
                reward=value,
                remove_sample=removed,
            )
            for _ in range(count)
        ]

    samples = (
        segments(10, 0, 3, 1.0)
        + segments(11, 0, 1, 0.0)
        + segments(20, 1, 2, 1.0)
        + segments(21, 1, 2, 1.0)
        + segments(22, 1, 1, 0.0, removed=True)
    )
    raw, normalized = post_process_rewards(_args(), samples)
    assert raw == [s.reward for s in samples]
    spread = 0.5 / (2**0.5 / 2 + 1e-6)  # group 0: mean 0.5, unbiased std sqrt(1/2)
    assert normalized[:4] == pytest.approx([spread] * 3 + [-spread])
    assert normalized[4:] == pytest.approx([0.0] * 5)  # group 1: equal rewards, removed: 0
    # slime's default would normalize the 9 segments as one batch, weighting by turns
    args = _args(grpo_std_normalization=False)
    assert post_process_rewards(args, samples)[1][:4] == pytest.approx([0.5] * 3 + [-0.5])
    assert post_process_rewards(_args(rewards_normalization=False), samples)[1] == raw


def test_rollout_metrics_count_each_trajectory_once(factory_tokenizer: Any) -> None:
    [mul, half, wrong] = _scripted(factory_tokenizer)
    aborted = wrong.model_copy(update={"status": TrajectoryStatus.ABORTED, "status_reason": "x"})
    samples = (
        to_samples(mul, _base(1), "kl")
        + to_samples(half, _base(2), "kl")
        + to_samples(aborted, _base(3), "kl")
    )
    extra: dict[str, Any] = {"rollout/existing": 1.0}
    assert hook_metrics.log_rollout(0, _args(), samples, extra, 1.0) is False
    assert extra["rollout/existing"] == 1.0
    assert extra["rollout/num_turns"] == pytest.approx((3 + 3 + 2) / 3)
    assert extra["rollout/abort_count/x"] == 1.0
    assert extra["rollout/masked_turn_frac_tier1"] == pytest.approx(1 / 8)
    per_trajectory = []
    for trajectory in (mul, half):  # the aborted one carries no training tokens
        s = torch.tensor([p for t in trajectory.turns for p in t.logprobs or []])
        t = torch.tensor([p for t in trajectory.turns for p in t.teacher_logprobs or []])
        per_trajectory.append(float((s - t).mean()))
    assert extra["rollout/opd_reverse_kl"] == pytest.approx(sum(per_trajectory) / 2)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_sft_rollout_feeds_records_unchanged_and_by_step(
    factory_tokenizer: Any, tmp_path: Path, suffix: str
) -> None:
    trajectories = _scripted(factory_tokenizer)
    records = [r for t in trajectories for r in turn_records(t)]
    path = tmp_path / f"sft{suffix}"
    assert write_records(path, records) == len(records)
    assert read_records(path) == records
    args = _args(opd_sft_data=str(path), rollout_batch_size=2, seed=0)
    seen = []
    for step in range(3):  # 6 trajectory slots over 3 trajectories: two epochs
        groups = generate_rollout(args, step, None, sample_class=Sample)
        assert generate_rollout(args, step, None, sample_class=Sample) == groups
        validate_rollout_id_annotated(groups)
        for [segments] in groups:
            trajectory_id = segments[0].metadata[METADATA_KEY]["trajectory_id"]
            seen.append(trajectory_id)
            expected = [r for r in records if r.trajectory_id == trajectory_id]
            assert [s.tokens for s in segments] == [r.tokens for r in expected]
            assert [s.loss_mask for s in segments] == [r.loss_mask for r in expected]
            assert len({s.rollout_id for s in segments}) == 1
    assert sorted(seen[:3]) == sorted(seen[3:]) == sorted(t.trajectory_id for t in trajectories)
    half = next(r for r in records if r.trajectory_id.startswith("half") and r.turn == 0)
    assert half.loss_mask == [0] * half.response_length  # tier 1: no imitation
    with pytest.raises(SFTDataError, match="evaluation"):
        generate_rollout(args, 0, None, evaluation=True, sample_class=Sample)


def test_generate_hook_end_to_end_through_slimes_call_site(
    factory_tokenizer: Any, factory_dir: Path, tmp_path: Path
) -> None:
    """slime's generate_and_rm_group -> our hook -> SGLang (stand-in) + teacher server (hf)
    -> per-turn samples -> slime's train-data conversion (the loss through slime's data
    path: tests/test_slime_real.py)."""
    student = build_model("qwen3-tiny", factory_tokenizer, seed=5).eval()
    teacher_dir = build_checkpoint("qwen3-tiny", tmp_path / "teacher", seed=8)
    metrics = ServerMetrics()
    backend = HFBackend(teacher_dir, metrics, max_context=4096)
    base = Sample(index=6, group_index=2, prompt="What is 2 + 3?", label="5")
    with _served_hook(
        backend,
        factory_dir,
        tmp_path,
        teacher={"kind": "remote"},
        max_turns=3,
        max_new_tokens=12,
        student=student,
    ) as hook:
        samples, _ = hook.generate(base, {"temperature": 1.0})
    args = hook.args
    assert isinstance(samples, list) and len(samples) >= 2  # junk replies: nudged, retried
    validate_rollout_id_annotated([[samples]])
    assert all(s.rollout_id == 6 and s.reward is not None for s in samples)
    for sample in samples:
        assert len(sample.rollout_log_probs) == sample.response_length
        assert len(sample.teacher_log_probs) == sample.response_length
        assert all(lp <= 0 for lp in sample.teacher_log_probs)
    for earlier, later in itertools.pairwise(samples):  # contexts grow
        prefix = earlier.tokens[: len(earlier.tokens) - earlier.response_length]
        assert later.tokens[: len(prefix)] == prefix
    assert metrics.tokens_scored_total == sum(s.response_length for s in samples)
    assert metrics.cached_tokens_total > 0  # one session per trajectory: prefix reuse
    assert args.custom_reward_post_process_path == "slime_ext.slime.reward.post_process_rewards"
    data = _train_data(args, samples)
    assert data["rollout_ids"] == [6] * len(samples)
    assert data["rollout_mask_sums"] == [sum(sum(s.loss_mask) for s in samples)] * len(samples)
    assert data["teacher_log_probs"] == [s.teacher_log_probs for s in samples]
    assert data["rewards"] == [0.0] * len(samples)  # one trajectory: its group's mean


def test_real_slime_sample_accepts_our_samples(factory_tokenizer: Any) -> None:
    """Runs only where slime is installed (its image): our samples are real Samples."""
    types = pytest.importorskip("slime.utils.types")
    trajectory = _scripted(factory_tokenizer)[0]
    base = types.Sample(index=3, group_index=0, prompt="p")
    samples = to_samples(trajectory, base, "kl")
    for sample in samples:
        assert isinstance(sample, types.Sample)
        sample._validate_response_metadata_lengths()
        assert types.Sample.from_dict(sample.to_dict()).tokens == sample.tokens
    assert "slime" in sys.modules


def test_real_slime_cp_slicing_matches_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs only where slime is installed: our CP layout against slime's own slicing."""
    cp_utils = pytest.importorskip("slime.backends.megatron_utils.cp_utils")
    from slime_ext.slime.cp import response_slices

    for cp_size in (2, 4):
        for cp_rank in range(cp_size):
            fake = type(
                "FakeMpu",
                (),
                {
                    "get_context_parallel_rank": staticmethod(lambda r=cp_rank: r),
                    "get_context_parallel_world_size": staticmethod(lambda s=cp_size: s),
                },
            )
            monkeypatch.setattr(cp_utils, "mpu", fake)
            for total in range(3, 40, 3):
                for response in range(1, total, 2):
                    values = [float(i) for i in range(response)]
                    expected = cp_utils.slice_log_prob_with_cp(values, total, response)
                    [ours] = response_slices([total], [response], cp_rank, cp_size)
                    assert [float(i) for i in ours.response_index] == list(expected)


def test_real_slime_carries_oprd_branch_shares_into_advantages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Runs only where slime is installed: slime's own compute_advantages_and_returns with
    our advantage function leaves each sample's branch share on every token of its slice,
    and refuses whitening."""
    loss_module = pytest.importorskip("slime.backends.megatron_utils.loss")
    fake = type("FakeMpu", (), {"is_pipeline_last_stage": staticmethod(lambda: True)})
    monkeypatch.setattr(loss_module, "mpu", fake)
    args = _args(
        kl_coef=0.0,
        custom_advantage_function_path="slime_ext.slime.oprd.advantages",
    )
    rollout_data: dict[str, Any] = {
        "rollout_log_probs": [torch.zeros(3), torch.zeros(2)],
        "rewards": [4.0, -2.0],
        "response_lengths": [3, 2],
        "total_lengths": [7, 5],
        "loss_masks": [torch.ones(3, dtype=torch.int), torch.ones(2, dtype=torch.int)],
    }
    loss_module.compute_advantages_and_returns(args, rollout_data)
    assert [a.tolist() for a in rollout_data["advantages"]] == [[4.0] * 3, [-2.0] * 2]
    with pytest.raises(HookConfigError, match="normalize-advantages"):
        whitened = _args(
            kl_coef=0.0,
            custom_advantage_function_path="slime_ext.slime.oprd.advantages",
            normalize_advantages=True,
        )
        loss_module.compute_advantages_and_returns(whitened, dict(rollout_data))


def test_opsd_generate_hook_scores_with_a_hinted_snapshot(
    factory_tokenizer: Any, factory_dir: Path, tmp_path: Path
) -> None:
    """Recipe opsd on slime: the teacher service is the student's own snapshot; the hook
    puts the reference hint into the teacher's contexts only."""
    backend = HFBackend(factory_dir, ServerMetrics(), max_context=4096)
    with _served_hook(
        backend, factory_dir, tmp_path, teacher={"kind": "self"}, algorithm={"recipe": "opsd"}
    ) as hook:
        samples, _ = hook.generate(_task_sample(9))
    assert samples and all(len(s.teacher_log_probs) == s.response_length for s in samples)
    hint = factory_tokenizer.decode(samples[0].tokens)
    assert "Hint" not in hint  # the student's context carries no hint
    differs = [
        abs(a - b) > 1e-4
        for s in samples
        for a, b in zip(s.rollout_log_probs, s.teacher_log_probs, strict=True)
    ]
    assert any(differs)  # the hinted snapshot scores the same tokens differently


def test_opsd_generate_hook_asks_slimes_router_for_the_students_own_hint(
    factory_tokenizer: Any, factory_dir: Path, tmp_path: Path
) -> None:
    """hint: student on slime: once the trajectory ended, the hook asks the rollout router
    (the policy that sampled it) for a hint, outside the trajectory's session; the hint
    never enters the student's samples and is counted in the hook's stats."""
    import httpx

    backend = HFBackend(factory_dir, ServerMetrics(), max_context=4096)
    teacher = {"kind": "self", "hint": "student", "hint_max_new_tokens": 8}
    with _served_hook(
        backend, factory_dir, tmp_path, teacher=teacher, algorithm={"recipe": "opsd"}
    ) as hook:
        samples, state = hook.generate(_task_sample(11))
        headers = httpx.get(f"{hook.router}/standin/headers").json()
    assert samples and all(len(s.teacher_log_probs) == s.response_length for s in samples)
    assert state.hints is not None and state.hints.reads_attempt
    stats = state.hints.stats
    assert stats.errors == 0 and stats.hints + stats.missing + stats.refused == 1
    logged = hook_metrics.sample_metrics(
        samples
    )  # what the rollout log function adds to slime's log
    assert {k: logged[k] for k in stats.metrics()} == stats.metrics()
    routed = [h for h in headers if "x-smg-routing-key" in h]
    assert len(headers) - len(routed) == 1  # the hint request: no trajectory session
    assert all("You review" not in factory_tokenizer.decode(s.tokens) for s in samples)


def test_oprd_samples_carry_their_branchs_loss_mask(factory_tokenizer: Any) -> None:
    """OPRD: a success (reward > 0) becomes imitation samples (its invalid turn masked), a
    failure KL samples (every turn trained), so slime's per-rollout mask sums are each
    branch's token count; both keep the teacher's log-probs (the branch KL metrics)."""
    [_, half, _] = _scripted(factory_tokenizer)
    assert half.turns[0].mask_tier is MaskTier.INVALID_ACTION
    won = half.model_copy(update={"reward": 1.0})
    lost = half.model_copy(update={"reward": 0.0})
    assert loss_kind("oprd", won) == "imitation" and loss_kind("oprd", lost) == "kl"
    assert loss_kind("opsd", won) == "kl" and loss_kind("ssd", lost) == "imitation"
    samples = to_samples(won, _base(1), loss_kind("oprd", won)) + to_samples(
        lost, _base(2), loss_kind("oprd", lost)
    )
    first = len(half.turns[0].span_ids)
    assert samples[0].loss_mask == [0] * first
    assert samples[half.num_turns].loss_mask == [1] * first
    data = _train_data(_args(), samples)
    assert data["rollout_mask_sums"][0] == half.span_token_count() - first
    assert data["rollout_mask_sums"][-1] == half.span_token_count()
    assert len(data["teacher_log_probs"]) == len(samples)


def test_oprd_generate_hook_scores_each_turn_with_its_reminders(
    factory_tokenizer: Any, factory_dir: Path, tmp_path: Path
) -> None:
    """Recipe oprd on slime: the served snapshot scores each turn's span after the student's
    exact context with the reminders active at that turn spliced in; no reminder reaches
    the student's samples; the local reminder raised by the first (invalid) reply is read
    before the next action only; the trajectory's own counts reach the rollout log."""
    from rollout.reminders import read_reminder_file

    class RecordingBackend(HFBackend):
        """The snapshot service's backend, keeping every item it was asked to score."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.items: list[Any] = []

        async def score(self, items: list[Any]) -> list[Any]:
            self.items += items
            return await super().score(items)

    backend = RecordingBackend(factory_dir, ServerMetrics(), max_context=4096)
    algorithm = {"recipe": "oprd", "oprd_failure_loss": "sampled"}
    with _served_hook(
        backend, factory_dir, tmp_path, teacher={"kind": "self"}, algorithm=algorithm
    ) as hook:
        samples, state = hook.generate(_task_sample(13))
    assert len(samples) == 2 and all(s.reward == 0.0 for s in samples)
    assert samples[0].metadata[METADATA_KEY]["mask_tier"] != 0  # junk: a local reminder
    assert all(s.loss_mask == [1] * s.response_length for s in samples)  # failure: KL mask
    reminders = state.reminders
    assert reminders is not None
    spec = read_reminder_file()
    task_global = spec.global_reminders["tir"][0]
    [invalid] = [rule.text for rule in spec.rules if rule.name == "invalid_action"]
    header = reminders.block_ids(["x"])[:6]  # the reminder message's opening ids
    decode = factory_tokenizer.decode
    requests = sorted(backend.items, key=lambda item: item.span_start)
    assert len(requests) == 2
    for k, (item, sample) in enumerate(zip(requests, samples, strict=True)):
        context = sample.tokens[: len(sample.tokens) - sample.response_length]
        assert item.input_ids[item.span_start :] == sample.tokens[len(context) :]
        expected = [task_global, invalid] if k == 1 else [task_global]
        cut = len(context) - len(reminders.generation_prompt)
        block = reminders.block_ids(expected)
        assert item.input_ids[: item.span_start] == context[:cut] + block + context[cut:]
        assert decode(item.input_ids[: item.span_start]).count(invalid) == k
        assert not any(
            sample.tokens[i : i + len(header)] == header for i in range(len(sample.tokens))
        )
        assert "Reminders" not in decode(sample.tokens) and task_global not in decode(sample.tokens)
    logged = hook_metrics.sample_metrics(samples)
    assert logged["rollout/reminder_global_count"] == 1  # the task's, raised at turn 0
    assert logged["rollout/reminder_local_count"] == 1  # shown at turn 1 only
    assert logged["rollout/reminder_context_frac"] == 1.0
    assert reminders.stats.contexts == 0  # counted per trajectory, not in the shared view
