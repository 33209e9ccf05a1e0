"""Property tests for the distillation losses, in the spirit of TRL's generalized_jsd_loss tests."""

from __future__ import annotations

import math

import pytest
import torch

from specdecode.training.losses import (
    LOSSES,
    expected_acceptance,
    forward_kl,
    get_loss,
    jsd,
    reverse_kl,
    token_count,
    tvd,
)

B, T, V = 3, 5, 11
ALL_LOSSES = sorted(LOSSES)


def _logits(seed: int, shape: tuple[int, ...] = (B, T, V), scale: float = 2.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float64).float() * scale


def _mask(seed: int, shape: tuple[int, int] = (B, T)) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(shape, generator=generator) < 0.6
    mask[0, 0] = True  # at least one counted position
    return mask


def _probs(logits: torch.Tensor) -> torch.Tensor:
    return logits.double().softmax(-1)


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_zero_on_identical_inputs(name: str) -> None:
    logits = _logits(0)
    loss = get_loss(name)(logits, logits.clone(), _mask(1))
    assert loss.item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("name", ALL_LOSSES)
@pytest.mark.parametrize("seed", range(5))
def test_non_negative_and_positive_on_different_inputs(name: str, seed: int) -> None:
    loss = get_loss(name)(_logits(seed), _logits(seed + 100), _mask(seed))
    assert loss.item() > 1e-4


def test_kls_match_direct_formula() -> None:
    student, teacher = _logits(2), _logits(3)
    p, q = _probs(teacher), _probs(student)
    expected_forward = (p * (p.log() - q.log())).sum(-1).mean()
    expected_reverse = (q * (q.log() - p.log())).sum(-1).mean()
    assert forward_kl(student, teacher).item() == pytest.approx(expected_forward.item(), rel=1e-5)
    assert reverse_kl(student, teacher).item() == pytest.approx(expected_reverse.item(), rel=1e-5)


def test_jsd_matches_definition() -> None:
    student, teacher = _logits(4), _logits(5)
    p, q = _probs(teacher), _probs(student)
    beta = 0.3
    m = beta * p + (1 - beta) * q
    expected = beta * (p * (p / m).log()).sum(-1) + (1 - beta) * (q * (q / m).log()).sum(-1)
    assert jsd(student, teacher, beta=beta).item() == pytest.approx(expected.mean().item(), rel=1e-5)


def test_jsd_rescaled_limits_are_the_kls() -> None:
    student, teacher = _logits(6, scale=1.0), _logits(7, scale=1.0)
    small = 1e-4
    near_forward = jsd(student, teacher, beta=small) / small
    near_reverse = jsd(student, teacher, beta=1 - small) / small
    # Both limits are approached at O(beta), so 1e-4 gives ~4 digits; 1e-2 would already be off.
    assert near_forward.item() == pytest.approx(forward_kl(student, teacher).item(), rel=2e-3)
    assert near_reverse.item() == pytest.approx(reverse_kl(student, teacher).item(), rel=2e-3)
    # The two KLs differ here, so a swapped convention would fail the asserts above.
    assert forward_kl(student, teacher).item() != pytest.approx(reverse_kl(student, teacher).item(), rel=0.05)


def test_jsd_symmetric_at_half() -> None:
    a, b, mask = _logits(8), _logits(9), _mask(10)
    assert jsd(a, b, mask, beta=0.5).item() == pytest.approx(jsd(b, a, mask, beta=0.5).item(), rel=1e-6)
    # And not symmetric away from 0.5, so the test above tests something.
    assert jsd(a, b, beta=0.2).item() != pytest.approx(jsd(b, a, beta=0.2).item(), rel=1e-3)


def test_jsd_bounded_by_binary_entropy() -> None:
    beta = 0.3
    bound = -(beta * math.log(beta) + (1 - beta) * math.log(1 - beta))
    assert jsd(_logits(11, scale=50.0), _logits(12, scale=50.0), beta=beta).item() <= bound + 1e-6


@pytest.mark.parametrize("beta", [0.0, 1.0, -0.1, 1.5, True])
def test_jsd_rejects_beta_outside_open_interval(beta: float) -> None:
    with pytest.raises(ValueError, match="beta"):
        jsd(_logits(0), _logits(1), beta=beta)


def test_tvd_is_one_minus_expected_acceptance_and_half_l1() -> None:
    student, teacher, mask = _logits(13), _logits(14), _mask(15)
    distance = tvd(student, teacher, mask)
    acceptance = expected_acceptance(student, teacher, mask)
    torch.testing.assert_close(distance, 1 - acceptance, atol=1e-6, rtol=0)
    p, q = _probs(teacher), _probs(student)
    expected = (0.5 * (p - q).abs().sum(-1))[mask].mean()
    assert distance.item() == pytest.approx(expected.item(), abs=1e-6)


def test_expected_acceptance_extremes() -> None:
    logits = _logits(16)
    assert expected_acceptance(logits, logits).item() == pytest.approx(1.0, abs=1e-6)
    one_hot_a = torch.full((1, 1, V), float("-inf"))
    one_hot_a[..., 0] = 0.0
    one_hot_b = torch.full((1, 1, V), float("-inf"))
    one_hot_b[..., 1] = 0.0
    assert expected_acceptance(one_hot_a, one_hot_b).item() == 0.0
    assert tvd(one_hot_a, one_hot_b).item() == 1.0


def _truncated_student(seed: int) -> torch.Tensor:
    """A drafter that only knows the first V - 4 tokens: -inf logits outside its vocabulary."""
    student = _logits(seed)
    student[..., V - 4 :] = float("-inf")
    return student


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_finite_values_and_gradients_with_minus_inf_student(name: str) -> None:
    student = _truncated_student(17).requires_grad_()
    loss = get_loss(name)(student, _logits(18), _mask(19))
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(student.grad).all()
    assert student.grad.abs().sum() > 0


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_finite_values_and_gradients_with_teacher_zeros(name: str) -> None:
    teacher = _logits(20)
    teacher[..., :3] = float("-inf")  # p = 0 on tokens the student still rates
    student = _truncated_student(21).requires_grad_()
    loss = get_loss(name)(student, teacher, _mask(22))
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(student.grad).all()


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_both_zero_on_same_tokens_matches_smaller_vocab(name: str) -> None:
    # Tokens neither model can emit must not change the loss: the loss over the padded vocabulary
    # equals the loss over the shared one.
    student, teacher = _logits(23), _logits(24)
    student_padded = torch.cat([student, torch.full((B, T, 3), float("-inf"))], dim=-1).requires_grad_()
    teacher_padded = torch.cat([teacher, torch.full((B, T, 3), float("-inf"))], dim=-1)
    loss = get_loss(name)(student_padded, teacher_padded)
    loss.backward()
    assert loss.item() == pytest.approx(get_loss(name)(student, teacher).item(), rel=1e-5)
    assert torch.isfinite(student_padded.grad).all()


def test_forward_kl_floor_applies_only_to_minus_inf() -> None:
    # A finite but tiny log q keeps its gradient: the student must be able to raise a token it
    # currently rates far below the floor.
    student = torch.zeros(1, 1, 3)
    student[..., 1] = -40.0
    student.requires_grad_()
    teacher = torch.zeros(1, 1, 3)
    forward_kl(student, teacher).backward()
    assert student.grad[0, 0, 1] < 0  # gradient descent raises the logit


@pytest.mark.parametrize("name", ALL_LOSSES)
@pytest.mark.parametrize("padded_side", ["student", "teacher"])
def test_mask_excludes_positions(name: str, padded_side: str) -> None:
    student, teacher, mask = _logits(25), _logits(26), _mask(27)
    loss = get_loss(name)(student, teacher, mask)
    changed_student, changed_teacher = student.clone(), teacher.clone()
    changed_student[~mask] = _logits(28)[~mask]
    changed_teacher[~mask] = _logits(29)[~mask]
    # Even all -inf rows (padding) at masked-out positions must not leak NaN into value or grad.
    (changed_student if padded_side == "student" else changed_teacher)[~mask] = float("-inf")
    changed_student = changed_student.requires_grad_()
    changed = get_loss(name)(changed_student, changed_teacher, mask)
    assert changed.item() == pytest.approx(loss.item(), rel=1e-6)
    changed.backward()
    assert torch.isfinite(changed_student.grad).all()
    assert (changed_student.grad[~mask] == 0).all()
    # And the counted positions do matter.
    other_student = student.clone()
    other_student[mask] = _logits(30)[mask]
    assert get_loss(name)(other_student, teacher, mask).item() != pytest.approx(loss.item(), rel=1e-4)


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_integer_mask_equals_bool_mask(name: str) -> None:
    student, teacher, mask = _logits(30), _logits(31), _mask(32)
    assert get_loss(name)(student, teacher, mask.long()).item() == pytest.approx(
        get_loss(name)(student, teacher, mask).item(), rel=1e-6
    )


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_per_token_normalisation_across_micro_batches(name: str) -> None:
    loss_fn = get_loss(name)
    # Two micro-batches with different lengths and very different token counts.
    student_a, teacher_a = _logits(33, (2, 3, V)), _logits(34, (2, 3, V))
    mask_a = torch.tensor([[True, False, False], [False, False, False]])
    student_b, teacher_b = _logits(35, (2, 5, V)), _logits(36, (2, 5, V))
    mask_b = torch.tensor([[True, True, True, True, True], [True, True, True, True, False]])

    total = loss_fn(student_a, teacher_a, mask_a, reduction="sum") + loss_fn(
        student_b, teacher_b, mask_b, reduction="sum"
    )
    accumulated = total / (token_count(mask_a, student_a) + token_count(mask_b, student_b))

    # The same tokens in one batch, micro-batch a padded to T = 5 with masked-out positions.
    pad = torch.zeros(2, 2, V)
    student = torch.cat([torch.cat([student_a, pad], dim=1), student_b])
    teacher = torch.cat([torch.cat([teacher_a, pad], dim=1), teacher_b])
    mask = torch.cat([torch.cat([mask_a, torch.zeros(2, 2, dtype=torch.bool)], dim=1), mask_b])
    whole = loss_fn(student, teacher, mask, reduction="mean")

    assert accumulated.item() == pytest.approx(whole.item(), rel=1e-6)
    # Averaging per micro-batch (1 token vs 9) weights differently: the check above can fail.
    per_micro_batch = (loss_fn(student_a, teacher_a, mask_a) + loss_fn(student_b, teacher_b, mask_b)) / 2
    assert per_micro_batch.item() != pytest.approx(whole.item(), rel=1e-3)


def test_token_count() -> None:
    logits = _logits(37)
    assert token_count(None, logits).item() == B * T
    assert token_count(_mask(38), logits).item() == int(_mask(38).sum())
    assert token_count(_mask(38).long(), logits).item() == int(_mask(38).sum())


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_empty_mask_gives_zero(name: str) -> None:
    empty = torch.zeros(B, T, dtype=torch.bool)
    assert get_loss(name)(_logits(39), _logits(40), empty).item() == 0.0


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_temperature_divides_logits_and_zero_means_one(name: str) -> None:
    loss_fn = get_loss(name)
    student, teacher = _logits(41), _logits(42)
    assert loss_fn(student, teacher, temperature=2.0).item() == pytest.approx(
        loss_fn(student / 2, teacher / 2).item(), rel=1e-5
    )
    assert loss_fn(student, teacher, temperature=0.0).item() == pytest.approx(
        loss_fn(student, teacher).item(), rel=1e-6
    )
    with pytest.raises(ValueError, match="-0.5"):
        loss_fn(student, teacher, temperature=-0.5)


def test_bf16_inputs_are_computed_in_fp32() -> None:
    student, teacher = _logits(43), _logits(44)
    loss = forward_kl(student.bfloat16(), teacher.bfloat16())
    assert loss.dtype == torch.float32
    reference = forward_kl(student.bfloat16().float(), teacher.bfloat16().float())
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)


def test_bad_arguments_are_named() -> None:
    student = _logits(45)
    with pytest.raises(ValueError, match="'median'"):
        forward_kl(student, student, reduction="median")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\(3, 5, 10\)"):
        tvd(student, student[..., :10])
    with pytest.raises(ValueError, match=r"\(3, 4\)"):
        jsd(student, student, torch.ones(3, 4, dtype=torch.bool))


def test_get_loss_names_unknown_and_valid() -> None:
    assert get_loss("jsd") is jsd
    assert set(LOSSES) == {"forward_kl", "reverse_kl", "jsd", "tvd"}
    with pytest.raises(ValueError, match="'kl_forward'") as error:
        get_loss("kl_forward")
    for name in LOSSES:
        assert name in str(error.value)
