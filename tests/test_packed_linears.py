"""Packed linears (specdecode.models.cpu_matmul.use_packed_linears): oneDNN over weights reordered
once, for a verify pass's 3..16 rows. Same numbers as F.linear, rebuilt when the weights change,
never on an autograd path, chosen by measurement, followed by drafters, and decoding stays exact."""

from __future__ import annotations

import copy
import re
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specdecode import speculative_generate
from specdecode.models import DrafterConfig, build_drafter, load_model
from specdecode.models.cpu_matmul import (
    PACKED_ROWS,
    SkinnyLinear,
    packed_available,
    packed_rows_of,
    skinny_rows_of,
    use_packed_linears,
    use_plain_linears,
    use_skinny_linears,
)
from tests.models_for_tests import tiny_llama

pytestmark = pytest.mark.skipif(not packed_available(), reason="this torch build has no oneDNN")


def _layers(with_bias: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 48, bias=with_bias), nn.Linear(48, 24, bias=False))


def _reference(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    return F.linear(F.linear(x, model[0].weight, model[0].bias), model[1].weight)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 17, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linears_match_f_linear_and_take_only_their_rows(rows: int, with_bias: bool) -> None:
    model = _layers(with_bias)
    assert use_packed_linears(model) == 2
    x = torch.randn(1, rows, 40)  # [B, T, H] as a verify pass feeds it
    with torch.inference_mode():
        out = model(x)
    assert out.shape == (1, rows, 24) and out.is_contiguous()
    torch.testing.assert_close(out, _reference(model, x), rtol=1e-5, atol=1e-5)
    # the reordered copy exists exactly where the packed product ran
    assert ("_packed" in vars(model[0])) is (PACKED_ROWS[0] <= rows <= PACKED_ROWS[1])


def test_the_packed_copy_follows_the_weights() -> None:
    """An optimizer step and a load_state_dict change the weights in place: the next inference
    call must use the new ones, not the copy reordered before."""
    model = _layers()
    use_packed_linears(model)
    x = torch.randn(4, 40)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for change in ("step", "load"):
        with torch.inference_mode():
            model(x)  # builds (or rebuilds) the reordered copies
        if change == "step":
            model(x).square().sum().backward()
            optimizer.step()
        else:
            model.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()})
        with torch.inference_mode():
            torch.testing.assert_close(model(x), _reference(model, x), rtol=1e-5, atol=1e-5)


def test_grad_mode_takes_f_linear() -> None:
    """Training sees F.linear's numbers and graph; no reordered copy is built for it."""
    model = _layers()
    use_packed_linears(model)
    x = torch.randn(4, 40)
    out = model(x)
    assert torch.equal(out, _reference(model, x)) and "_packed" not in vars(model[0])
    out.sum().backward()
    assert model[0].weight.grad is not None


def test_copies_and_plain_linears_drop_the_packed_copy() -> None:
    model = _layers()
    use_skinny_linears(model)
    use_packed_linears(model)
    x = torch.randn(4, 40)
    with torch.inference_mode():
        model(x)
    twin = copy.deepcopy(model)  # a oneDNN tensor has no storage to copy: the cache is left out
    assert "_packed" not in vars(twin[0]) and packed_rows_of(twin) == PACKED_ROWS
    with torch.inference_mode():
        torch.testing.assert_close(twin(x), _reference(model, x), rtol=1e-5, atol=1e-5)
    use_plain_linears(model)
    assert all(type(m) is nn.Linear and not {"_packed", "packed_rows", "skinny_rows"} & vars(m).keys() for m in model)
    use_packed_linears(twin, None)
    assert "_packed" not in vars(twin[0]) and packed_rows_of(twin) is None and skinny_rows_of(twin) is not None


@pytest.mark.parametrize("rows", [(0, 4), (3, 65), (5, 4), (3,)])
def test_use_packed_linears_refuses_bad_rows(rows: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"packed rows must be .*got " + re.escape(repr(rows))):
        use_packed_linears(nn.Linear(4, 4), rows)  # type: ignore[arg-type]


@pytest.mark.parametrize("packed_wins", [True, False])
def test_load_model_keeps_packed_linears_only_where_measured_faster(
    monkeypatch: pytest.MonkeyPatch, packed_wins: bool
) -> None:
    import specdecode.models.cpu_matmul as cpu_matmul
    import specdecode.models.kernel_choice as kernel_choice
    import specdecode.models.loading as loading

    monkeypatch.setattr(loading, "cached_packed_rows", kernel_choice.cached_packed_rows)  # conftest pins it
    real_packed, real_linear = SkinnyLinear._packed_forward, F.linear
    slow = 0.002  # seconds per call of the losing kernel: far above a tiny model's timing noise

    def packed(self: SkinnyLinear, x: torch.Tensor) -> torch.Tensor:
        if not packed_wins:
            time.sleep(slow)
        return real_packed(self, x)

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if packed_wins and x.numel() // x.shape[-1] >= PACKED_ROWS[0]:
            time.sleep(slow)
        return real_linear(x, weight, bias)

    monkeypatch.setattr(SkinnyLinear, "_packed_forward", packed)
    monkeypatch.setattr(cpu_matmul.F, "linear", linear)
    model, _ = load_model("smoke")  # skinny linears measured off by conftest: F.linear is the rival
    if packed_wins:
        assert packed_rows_of(model) == PACKED_ROWS
    else:  # back as it was: plain linears, no second copy of the weights kept
        assert packed_rows_of(model) is None
        assert not any(isinstance(m, SkinnyLinear) or "_packed" in vars(m) for m in model.modules())


@pytest.mark.parametrize("kind", ["derived", "feature"])
def test_drafters_follow_the_targets_packed_rows(kind: str) -> None:
    for rows in (PACKED_ROWS, None):
        target, tokenizer = load_model("smoke", skinny_matmul=False)
        use_packed_linears(target, rows)
        drafter = build_drafter(DrafterConfig(kind=kind, num_layers=1, draft_vocab=None), target, tokenizer, lambda: [])
        assert packed_rows_of(drafter) == rows


@pytest.mark.parametrize("gamma", [2, 3, 4])
def test_greedy_with_packed_linears_matches_transformers(gamma: int) -> None:
    """Verify passes of gamma + 1 rows per prompt (3..5 at batch 1, more batched) through the packed
    product decode what transformers' greedy decodes with the plain model, ragged batch and alone."""
    plain = tiny_llama(2, seed=0)
    target, drafter = copy.deepcopy(plain), tiny_llama(1, seed=1)
    for model in (target, drafter):
        use_skinny_linears(model, (1, 64))
        use_packed_linears(model)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 64, (n,), generator=generator).tolist() for n in (3, 7, 1, 12)]
    expected = [
        plain.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, pad_token_id=0)[0, len(p) :].tolist()
        for p in prompts
    ]
    assert (
        speculative_generate(target, drafter, prompts, gamma=gamma, max_new_tokens=20, eos_token_ids=[]).sequences
        == expected
    )
    for prompt, tokens in zip(prompts, expected):
        assert speculative_generate(
            target, drafter, [prompt], gamma=gamma, max_new_tokens=20, eos_token_ids=[]
        ).sequences == [tokens]
    assert "_packed" in vars(target.model.layers[0].mlp.down_proj)  # the packed product did run


def _failing(*args: object) -> torch.Tensor:
    raise RuntimeError("no kernel for this layout")


@pytest.mark.parametrize("failing_op", ["_linear_pointwise", "_reorder_linear_weight"])
def test_a_failing_private_op_falls_back_to_the_plain_kernel(monkeypatch: pytest.MonkeyPatch, failing_op: str) -> None:
    """torch.ops.mkldnn's ops are private: where one raises, the layer computes F.linear's product
    on its plain kernel, says so once, and stays plain; nothing new is packed."""
    model = _layers()
    use_packed_linears(model)
    x = torch.randn(4, 40)
    monkeypatch.setattr(torch.ops.mkldnn, failing_op, _failing)
    with torch.inference_mode(), pytest.warns(UserWarning, match="packed linears off.*no kernel for this layout"):
        out = model(x)
    torch.testing.assert_close(out, _reference(model, x), rtol=1e-5, atol=1e-5)
    assert packed_rows_of(model) is None and not any("_packed" in vars(m) for m in model)
    assert not packed_available()
    with pytest.raises(ValueError, match="oneDNN"):
        use_packed_linears(_layers())


def test_without_the_private_ops_nothing_is_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch without torch.ops.mkldnn's ops: the choice times nothing and picks no packed rows,
    and a model packed before decodes on its plain kernels."""
    from types import SimpleNamespace

    from specdecode.models.kernel_choice import cached_packed_rows, measure_packed_rows

    packed = _layers()
    use_packed_linears(packed)
    monkeypatch.setattr(torch.ops, "mkldnn", SimpleNamespace())
    assert not packed_available()
    target = tiny_llama(1, seed=0)
    assert measure_packed_rows(target) is None and cached_packed_rows(target) is None
    x = torch.randn(3, 40)
    with torch.inference_mode(), pytest.warns(UserWarning, match="packed linears off.*missing"):
        out = packed(x)
    torch.testing.assert_close(out, _reference(packed, x), rtol=1e-5, atol=1e-5)
