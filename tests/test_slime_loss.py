"""The custom loss slime calls (slime_ext.slime.loss): what it refuses, and OPRD's branch
shares. Its values and gradients through slime's own data path, for every recipe and
TP x CP layout, are in tests/test_slime_real.py; these tests feed the hook a batch by
hand, in the layout slime's get_batch gives it (one CP rank: whole responses), to pin
down its input checks.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from slime_ext.slime import oprd
from slime_ext.slime.loss import SlimeBatchError
from slime_ext.slime.loss import loss as opd_loss
from slime_ext.slime.settings import HookConfigError
from tests.slime_driver import sample_class

VOCAB = 16
TEMPERATURE = 0.7
LAYOUT = [(5, 4), (11, 3), (7, 2)]
"""(prompt tokens, response tokens) per sample, one rollout each."""


def _job_yaml(directory: Path, recipe: str = "opd", extra: str = "") -> Path:
    path = directory / "job.yaml"
    teacher = "kind: self" if recipe in ("opsd", "oprd") else "kind: remote"
    algorithm = f"recipe: {recipe}" + ("\n  oprd_failure_loss: sampled" if recipe == "oprd" else "")
    path.write_text(
        f"rollout:\n  temperature: {TEMPERATURE}\nalgorithm:\n  {algorithm}{extra}\n"
        f"teacher:\n  {teacher}\n  url: http://127.0.0.1:1\n  top_k: 4\n"
    )
    return path


def _args(**overrides: Any) -> SimpleNamespace:
    """The attributes of slime's args the hook reads (slime's defaults)."""
    values = {
        "rollout_temperature": TEMPERATURE,
        "use_rollout_logprobs": False,
        "eps_clip": 0.2,
        "eps_clip_high": None,
        "log_probs_chunk_size": -1,
        "rollout_top_p": 1.0,
    }
    return SimpleNamespace(**(values | overrides))


def _batch(with_teacher: bool = True) -> tuple[dict[str, Any], torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tokens, totals, responses = [], [], []
    for prompt, response in LAYOUT:
        tokens.append(torch.randint(0, VOCAB, (prompt + response,), generator=generator))
        totals.append(prompt + response)
        responses.append(response)
    batch: dict[str, Any] = {
        "unconcat_tokens": tokens,
        "total_lengths": totals,
        "response_lengths": responses,
        "loss_masks": [torch.ones(r, dtype=torch.int) for r in responses],
        "rollout_mask_sums": [torch.tensor(float(r)) for r in responses],
        "teacher_log_probs": [-torch.rand(r, generator=generator) for r in responses]
        if with_teacher
        else None,
        "log_probs": None,
        "rollout_log_probs": None,
        "advantages": None,
    }
    logits = torch.randn(1, sum(totals), VOCAB, generator=generator, requires_grad=True)
    return batch, logits


def _call(args: Any, batch: dict[str, Any], logits: torch.Tensor) -> Any:
    return opd_loss(args, batch, logits, lambda x: x.sum())


def test_loss_refuses_a_temperature_the_job_does_not_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPD_JOB_CONFIG", str(_job_yaml(tmp_path)))
    batch, logits = _batch()
    with pytest.raises(HookConfigError, match="rollout-temperature"):
        _call(_args(rollout_temperature=1.0), batch, logits)
    loss, log = _call(_args(), batch, logits)  # the control: the job's temperature
    assert torch.isfinite(loss) and float(log["loss_tokens"]) == sum(r for _, r in LAYOUT)


def test_teacher_logprobs_of_the_wrong_length_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPD_JOB_CONFIG", str(_job_yaml(tmp_path)))
    batch, logits = _batch()
    batch["teacher_log_probs"][1] = batch["teacher_log_probs"][1][:-1]
    with pytest.raises(SlimeBatchError, match="invariant 2"):
        _call(_args(), batch, logits)
    batch, logits = _batch(with_teacher=False)  # slime copies them only if sample 0 has them
    with pytest.raises(SlimeBatchError, match="teacher_log_probs"):
        _call(_args(), batch, logits)


def test_topk_loss_checks_the_rows_it_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the rows (slime not extended by topk.init) the loss names the hook; rows
    that do not fit their samples are refused; fitting rows give the KL and its metric."""
    from slime_ext.slime.topk import TOPK_IDS, TOPK_LOGPROBS, TopKError

    monkeypatch.setenv("OPD_JOB_CONFIG", str(_job_yaml(tmp_path, extra="\n  opd_loss: topk_tail")))
    batch, logits = _batch()
    with pytest.raises(HookConfigError, match="custom-megatron-init-path"):
        _call(_args(), batch, logits)
    generator = torch.Generator().manual_seed(1)
    lengths = batch["response_lengths"]
    batch[TOPK_IDS] = [torch.randint(0, VOCAB, (r, 4), generator=generator) for r in lengths]
    batch[TOPK_LOGPROBS] = [-3 - torch.rand(r, 4, generator=generator) for r in lengths]
    loss, metrics = _call(_args(), batch, logits)
    assert float(loss) > 0 and float(metrics["teacher_topk_kl"]) == pytest.approx(float(loss))
    loss.backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    short = dict(batch, **{TOPK_IDS: [t[:-1] for t in batch[TOPK_IDS]]})
    with pytest.raises(TopKError, match="top-k ids"):
        _call(_args(), short, logits)
    narrow = dict(batch)
    narrow[TOPK_IDS] = [t[:, :2] for t in batch[TOPK_IDS]]
    narrow[TOPK_LOGPROBS] = [t[:, :2] for t in batch[TOPK_LOGPROBS]]
    with pytest.raises(TopKError, match=r"teacher\.top_k 4"):
        _call(_args(), narrow, logits)
    foreign = dict(batch, **{TOPK_IDS: [t + VOCAB for t in batch[TOPK_IDS]]})
    with pytest.raises(SlimeBatchError, match="another tokenizer"):
        _call(_args(), foreign, logits)


def test_oprd_loss_without_branch_shares_names_the_missing_hook(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPD_JOB_CONFIG", str(_job_yaml(tmp_path, "oprd")))
    batch, logits = _batch()
    with pytest.raises(SlimeBatchError, match="custom-advantage-function-path"):
        _call(_args(), batch, logits)


def test_oprd_branch_shares_divide_each_training_step_among_its_branches() -> None:
    """A step is --global-batch-size consecutive rollouts (first seen first); a success's
    share is G / successes, a failure's -G / failures, a removed placeholder's 0."""
    Sample = sample_class()

    def sample(rollout_id: int, reward: float, removed: bool = False) -> Any:
        return Sample(rollout_id=rollout_id, reward=reward, remove_sample=removed)

    # step 1: 5 (success, two samples), 7 (failure); step 2: 9 (failure), 11 (removed);
    # step 3 (beyond the steps slime trains; still routed): 13 (success)
    samples = [
        sample(5, 1.0), sample(7, 0.0), sample(5, 1.0), sample(9, -1.0),
        sample(11, 0.0, removed=True), sample(13, 0.5),
    ]  # fmt: skip
    args = SimpleNamespace(global_batch_size=2, reward_key=None)
    raw, shares = oprd.post_process_rewards(args, samples)
    assert raw == [s.reward for s in samples]
    assert shares == [2.0, -2.0, 2.0, -2.0, 0.0, 2.0]
    # with one step of all six: G = 6 over 2 successes and 2 failures
    assert oprd.branch_shares(samples, raw, global_batch_size=6) == [3.0, -3.0, 3.0, -3.0, 0, 3.0]


def _padded_logprobs(batch: dict[str, Any], logits: torch.Tensor) -> list[torch.Tensor]:
    """What slime's own log-prob path gives (its recomputed `log_probs`): the log-softmax
    over every column of Megatron's output layer, padding columns too."""
    rows = torch.log_softmax(logits[0].detach() / TEMPERATURE, dim=-1)
    out, start = [], 0
    for tokens, total, response in zip(
        batch["unconcat_tokens"], batch["total_lengths"], batch["response_lengths"], strict=True
    ):
        positions = torch.arange(total - response - 1, total - 1)
        out.append(rows[start + positions, tokens[total - response :]])
        start += total
    return out


def test_padded_vocabulary_columns_take_no_mass_and_the_first_step_ratio_is_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Megatron pads the output layer past the checkpoint's vocabulary (--vocab-size);
    the engines have no such columns. The student's log-probs leave them out, and slime's
    recomputed old log-probs (which include them) are shifted to match, so at the weights
    they were computed under the policy-gradient ratio is 1 and the loss is the reverse KL
    over the real vocabulary."""
    monkeypatch.setenv("OPD_JOB_CONFIG", str(_job_yaml(tmp_path, extra="\n  kl_coef: 1.0")))
    batch, logits = _batch()
    real = VOCAB - 5
    for tokens in batch["unconcat_tokens"]:
        tokens.clamp_(max=real - 1)
    with torch.no_grad():  # padding columns: the zero rows Megatron adds give logit 0
        logits[..., real:] = 0.0
    batch["log_probs"] = _padded_logprobs(batch, logits)
    loss, log = _call(_args(vocab_size=real), batch, logits)
    rows = torch.log_softmax(logits[0].detach()[:, :real] / TEMPERATURE, dim=-1)
    expected, start = [], 0
    for tokens, total, response, teacher in zip(
        batch["unconcat_tokens"], batch["total_lengths"], batch["response_lengths"],
        batch["teacher_log_probs"], strict=True,
    ):  # fmt: skip
        positions = torch.arange(total - response - 1, total - 1)
        student = rows[start + positions, tokens[total - response :]]
        expected.append(float((student - teacher).sum()))  # the hook's reducer: a sum
        start += total
    assert float(log["opd_reverse_kl"]) == pytest.approx(sum(expected), rel=1e-5)
    assert float(loss) == pytest.approx(sum(expected), rel=1e-5)  # ratio 1: loss = KL
    # the control: without --vocab-size the padding columns count, and both move
    padded_loss, padded_log = _call(_args(), batch, logits)
    assert abs(float(padded_log["opd_reverse_kl"]) - sum(expected)) > 1e-2
    assert abs(float(padded_loss) - sum(expected)) > 1e-2


def test_kl_discount_charges_each_token_for_its_samples_later_loss_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """algorithm.kl_discount on slime's path (a trajectory is one sample, cp 1): each loss
    token's advantage sums the reverse KL of its sample's loss tokens from it on, discounted
    per loss token; a masked token (an observation) adds nothing and is not counted."""
    gamma = 0.5
    job_yaml = _job_yaml(tmp_path, extra=f"\n  kl_discount: {gamma}")
    monkeypatch.setenv("OPD_JOB_CONFIG", str(job_yaml))
    batch, logits = _batch()
    batch["loss_masks"][0] = torch.tensor([1, 0, 1, 1], dtype=torch.int)  # an observation
    loss, log = _call(_args(), batch, logits)
    rows = torch.log_softmax(logits[0].detach() / TEMPERATURE, dim=-1)
    expected, plain, start = 0.0, 0.0, 0
    for tokens, total, response, teacher, mask in zip(
        batch["unconcat_tokens"], batch["total_lengths"], batch["response_lengths"],
        batch["teacher_log_probs"], batch["loss_masks"], strict=True,
    ):  # fmt: skip
        positions = torch.arange(total - response - 1, total - 1)
        k = (rows[start + positions, tokens[total - response :]] - teacher).tolist()
        kept = [value for value, carries in zip(k, mask.tolist(), strict=True) if carries]
        for t in range(len(kept)):
            expected += sum(gamma**d * value for d, value in enumerate(kept[t:]))
        plain += sum(kept)
        start += total
    assert float(loss) == pytest.approx(expected, rel=1e-5)  # ratio 1: loss = -advantage
    assert float(log["opd_reverse_kl"]) == pytest.approx(plain, rel=1e-5)  # k_t, undiscounted
    assert abs(expected - plain) > 1e-2  # the discount changed the loss
