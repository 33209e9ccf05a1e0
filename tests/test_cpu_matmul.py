"""Skinny linears (specdecode.models.cpu_matmul): same numbers as F.linear, same checkpoints, the
ordinary path for training, row-major outputs, and decoding with them stays exact."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaForCausalLM

from specdecode import speculative_generate
from specdecode.models import load_model
from specdecode.models.cpu_matmul import SKINNY_MAX_ROWS, SkinnyLinear, skinny_linear, use_skinny_linears, uses_skinny_linears
from specdecode.models.loading import cast_copy
from tests.models_for_tests import tiny_llama, tiny_llama_config


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, 200])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_linear_matches_f_linear(rows: int, with_bias: bool) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(48, 40)
    bias = torch.randn(48) if with_bias else None
    x = torch.randn(1, rows, 40)  # [B, T, H] as a verify pass feeds it
    out = skinny_linear(x, weight, bias)
    assert out.shape == (1, rows, 48)
    # Row-major output: a transposed view here would hand attention a last-dim stride != 1.
    assert out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_skinny_linear_accepts_a_column_major_input() -> None:
    """An input that is itself a transposed view (another op's output) gives the same result."""
    weight, x = torch.randn(24, 16), torch.randn(16, 3).t()  # [3, 16], strides (1, 3)
    torch.testing.assert_close(skinny_linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_inputs_that_need_grad_take_the_ordinary_path() -> None:
    """Training must see F.linear's numbers and graph, not the inference kernel."""
    weight = torch.randn(8, 6, requires_grad=True)
    x = torch.randn(4, 6)
    out = skinny_linear(x, weight)
    assert type(out.grad_fn).__name__ == type(F.linear(x, weight).grad_fn).__name__
    assert torch.equal(out, F.linear(x, weight))
    out.sum().backward()
    assert weight.grad is not None and weight.grad.shape == weight.shape


def test_use_skinny_linears_changes_the_class_only() -> None:
    model = tiny_llama(2, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    linears = sum(type(m) is nn.Linear for m in model.modules())

    assert use_skinny_linears(model) == linears > 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_use_skinny_linears_leaves_subclasses_alone() -> None:
    class Scaled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    model = nn.Sequential(nn.Linear(4, 4), Scaled(4, 4))
    assert use_skinny_linears(model) == 1
    assert type(model[1]) is Scaled


def test_tied_weights_stay_tied() -> None:
    model = LlamaForCausalLM(tiny_llama_config())  # ties the LM head to the embeddings
    assert model.lm_head.weight is model.get_input_embeddings().weight
    use_skinny_linears(model)
    assert isinstance(model.lm_head, SkinnyLinear)
    assert model.lm_head.weight is model.get_input_embeddings().weight


def test_load_model_switch() -> None:
    on, _ = load_model("smoke", skinny_matmul=True)
    off, _ = load_model("smoke", skinny_matmul=False)
    assert any(isinstance(m, SkinnyLinear) for m in on.modules())
    assert not any(isinstance(m, SkinnyLinear) for m in off.modules())


@pytest.mark.parametrize("skinny_wins", [True, False])
def test_load_model_keeps_the_kernel_measured_faster(monkeypatch: pytest.MonkeyPatch, skinny_wins: bool) -> None:
    """skinny_matmul=None (the default) times both kernels and keeps the faster one."""
    import specdecode.models.cpu_matmul as cpu_matmul

    real_linear = F.linear
    slow = 0.002  # seconds per few-row call of the losing kernel: far above a tiny model's timing noise

    def timed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if skinny_wins and x.numel() // x.shape[-1] > 1:
            time.sleep(slow)
        return real_linear(x, weight, bias)

    def timed_skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not skinny_wins:
            time.sleep(slow)
        return real_linear(x, weight, bias)

    monkeypatch.setattr(cpu_matmul.F, "linear", timed_linear)
    monkeypatch.setattr(SkinnyLinear, "forward", lambda self, x: timed_skinny(x, self.weight, self.bias))
    model, _ = load_model("smoke")
    assert cpu_matmul.uses_skinny_linears(model) is skinny_wins


def test_the_measurement_leaves_the_models_kernels_as_they_were() -> None:
    from specdecode.models.cpu_matmul import skinny_is_faster, uses_skinny_linears

    for skinny in (True, False):
        model, _ = load_model("smoke", skinny_matmul=skinny)
        skinny_is_faster(model, widths=(2, 3), repeats=1)
        assert uses_skinny_linears(model) is skinny


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_with_skinny_linears_matches_transformers(gamma: int) -> None:
    """The fast path decodes what transformers' greedy decodes with the plain model, ragged batch."""
    plain = tiny_llama(2, seed=0)
    target, drafter = copy.deepcopy(plain), tiny_llama(1, seed=1)
    use_skinny_linears(target)
    use_skinny_linears(drafter)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 64, (n,), generator=generator).tolist() for n in (3, 7, 1, 12)]
    expected = [
        plain.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, pad_token_id=0)[0, len(p) :].tolist()
        for p in prompts
    ]
    result = speculative_generate(target, drafter, prompts, gamma=gamma, max_new_tokens=20, eos_token_ids=[])
    assert result.sequences == expected
    assert result.sequences[:1] == speculative_generate(
        target, drafter, prompts[:1], gamma=gamma, max_new_tokens=20, eos_token_ids=[]
    ).sequences


@pytest.mark.parametrize("kind", ["derived", "feature"])
def test_derived_drafters_follow_the_targets_kernels(kind: str) -> None:
    from specdecode.models import DrafterConfig, build_drafter

    for skinny in (True, False):
        target, tokenizer = load_model("smoke", skinny_matmul=skinny)
        drafter = build_drafter(DrafterConfig(kind=kind, num_layers=1, draft_vocab=None), target, tokenizer, lambda: [])
        assert any(isinstance(m, SkinnyLinear) for m in drafter.modules()) is skinny


def test_cast_copy_is_a_plain_copy_in_the_new_dtype_and_leaves_the_model_alone() -> None:
    """The bf16 copy that writes training data: same weights rounded, plain linears (the skinny
    kernel was timed for the original's dtype), frozen; the original keeps its dtype and kernel."""
    model, _ = load_model("smoke", skinny_matmul=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    copy = cast_copy(model, torch.bfloat16)
    assert copy is not model and copy.dtype == torch.bfloat16 and not copy.training
    assert not uses_skinny_linears(copy) and uses_skinny_linears(model)
    assert not any(p.requires_grad for p in copy.parameters())
    assert all(torch.equal(v, before[k]) and v.dtype == torch.float32 for k, v in model.state_dict().items())
    assert all(torch.equal(v, before[k].to(torch.bfloat16)) for k, v in copy.state_dict().items())
    assert cast_copy(model, torch.float32) is model
