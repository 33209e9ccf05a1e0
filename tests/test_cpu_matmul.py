"""Skinny linears (specdecode.models.cpu_matmul): same numbers as F.linear, same checkpoints, the
ordinary path for training, row-major outputs, and decoding with them stays exact."""

from __future__ import annotations

import copy
import re
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaForCausalLM

from specdecode import speculative_generate
from specdecode.models import load_model
from specdecode.models.cpu_matmul import (
    FEW_ROWS,
    SKINNY_MAX_ROWS,
    SkinnyLinear,
    skinny_linear,
    skinny_rows_of,
    use_skinny_linears,
)
from specdecode.models.kernel_choice import measure_skinny_rows
from specdecode.models.loading import cast_copy
from tests.models_for_tests import tiny_llama, tiny_llama_config


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, 200])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("kernel_rows", [FEW_ROWS, (1, SKINNY_MAX_ROWS)])
def test_skinny_linear_matches_f_linear(rows: int, with_bias: bool, kernel_rows: tuple[int, int]) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(48, 40)
    bias = torch.randn(48) if with_bias else None
    x = torch.randn(1, rows, 40)  # [B, T, H] as a verify pass feeds it
    out = skinny_linear(x, weight, bias, kernel_rows)
    assert out.shape == (1, rows, 48)
    # Row-major output: a transposed view here would hand attention a last-dim stride != 1.
    assert out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_skinny_linear_accepts_a_column_major_input() -> None:
    """An input that is itself a transposed view (another op's output) gives the same result."""
    weight, x = torch.randn(24, 16), torch.randn(16, 3).t()  # [3, 16], strides (1, 3)
    torch.testing.assert_close(skinny_linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_a_single_row_is_computed_as_two(monkeypatch: pytest.MonkeyPatch) -> None:
    """With rows (1, ..) a one-row input reaches the matmul as two identical columns (MKL splits that
    over the cores) and only its own row comes back; with the default rows it stays F.linear's."""
    seen: list[tuple[int, ...]] = []
    real_mm = torch.mm

    def spy(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(b.shape))
        return real_mm(a, b)

    monkeypatch.setattr(torch, "mm", spy)
    weight, x = torch.randn(24, 16), torch.randn(1, 1, 16)
    out = skinny_linear(x, weight, None, (1, SKINNY_MAX_ROWS))
    assert seen == [(16, 2)] and out.shape == (1, 1, 24)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)
    skinny_linear(x, weight)
    assert seen == [(16, 2)]  # FEW_ROWS: the single row did not reach torch.mm


def test_a_truncated_draft_head_follows_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A drafter's truncated head (no nn.Linear) takes the same rows as the model's linears, and
    goes back to F.linear with them."""
    from specdecode.models.cpu_matmul import use_plain_linears
    from specdecode.models.draft_vocab import DraftVocabHead

    torch.manual_seed(0)
    full = torch.randn(40, 16)
    model = nn.Sequential(nn.Linear(16, 16), DraftVocabHead(full, torch.tensor([1, 5, 7, 30])))
    head = model[1]
    hidden = torch.randn(1, 1, 16)
    expected = F.linear(hidden, full[[1, 5, 7, 30]])
    use_skinny_linears(model, (1, SKINNY_MAX_ROWS))
    assert head.skinny_rows == (1, SKINNY_MAX_ROWS) and skinny_rows_of(model) == (1, SKINNY_MAX_ROWS)
    seen: list[tuple[int, ...]] = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: seen.append(tuple(b.shape)) or real_mm(a, b))
    with torch.inference_mode():  # as decoding runs it: a trainable head's weight needs grad otherwise
        torch.testing.assert_close(head.draft_logits(hidden), expected, rtol=1e-5, atol=1e-5)
        assert seen == [(16, 2)]
        use_plain_linears(model)
        assert head.skinny_rows is None
        torch.testing.assert_close(head.draft_logits(hidden), expected, rtol=1e-5, atol=1e-5)
        assert seen == [(16, 2)]


@pytest.mark.parametrize("rows", [(0, 4), (3, 2), (1, SKINNY_MAX_ROWS + 1), (2,)])
def test_use_skinny_linears_refuses_bad_rows(rows: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"skinny rows must be .*got " + re.escape(repr(rows))):
        use_skinny_linears(nn.Linear(4, 4), rows)  # type: ignore[arg-type]


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


@pytest.mark.parametrize(
    ("single_wins", "few_wins", "expected"),
    [(True, True, (1, SKINNY_MAX_ROWS)), (False, True, FEW_ROWS), (True, False, (1, 1)), (False, False, None)],
)
def test_load_model_keeps_the_kernel_measured_faster(
    monkeypatch: pytest.MonkeyPatch, single_wins: bool, few_wins: bool, expected: tuple[int, int] | None
) -> None:
    """skinny_matmul=None (opt-in) times both kernels and keeps the faster one, for a single
    row and for a verify's few rows apart."""
    import specdecode.models.cpu_matmul as cpu_matmul

    real_linear = F.linear
    slow = 0.002  # seconds per call of the losing kernel: far above a tiny model's timing noise

    def loses(x: torch.Tensor, skinny: bool) -> bool:
        wins = single_wins if x.numel() // x.shape[-1] == 1 else few_wins
        return wins != skinny

    def timed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if loses(x, skinny=False):
            time.sleep(slow)
        return real_linear(x, weight, bias)

    def timed_skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if loses(x, skinny=True):
            time.sleep(slow)
        return real_linear(x, weight, bias)

    monkeypatch.setattr(cpu_matmul.F, "linear", timed_linear)
    monkeypatch.setattr(SkinnyLinear, "forward", lambda self, x: timed_skinny(x, self.weight, self.bias))
    model, _ = load_model("smoke", skinny_matmul=None)
    assert skinny_rows_of(model) == expected


def test_the_kernel_pick_compares_the_kernels_round_by_round() -> None:
    """A kernel faster in most rounds wins though a drift in one round (the machine slowed while it
    ran) gives it the higher median of its own times; the warm-up round is left out."""
    from specdecode.models.kernel_choice import is_faster

    plain = {1: [99.0, 10, 10, 10, 50, 50]}
    skinny = {1: [1.0, 9, 9, 55, 45, 45]}  # faster in 4 of 5 rounds; medians 45 against 10
    assert is_faster({False: plain, True: skinny}, [1])
    assert not is_faster({False: skinny, True: plain}, [1])
    assert not is_faster({False: plain, True: skinny}, [])


def test_a_single_row_is_timed_over_more_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    import specdecode.models.kernel_choice as kernel_choice

    calls, real = [], kernel_choice.time_kernels

    def recording(model, widths, repeats, use):
        calls.append((widths, repeats))
        return real(model, widths, repeats, use)

    monkeypatch.setattr(kernel_choice, "time_kernels", recording)
    measure_skinny_rows(tiny_llama(1), widths=(1, 2, 3), repeats=2)
    assert calls == [((1,), 2 * kernel_choice.SINGLE_ROW_ROUNDS), ((2, 3), 2)] and kernel_choice.SINGLE_ROW_ROUNDS > 1


def test_the_measurement_leaves_the_models_kernels_as_they_were() -> None:
    for skinny in (True, False):
        model, _ = load_model("smoke", skinny_matmul=skinny)
        measure_skinny_rows(model, widths=(1, 2, 3), repeats=1)
        assert skinny_rows_of(model) == (FEW_ROWS if skinny else None)


@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("rows", [FEW_ROWS, (1, SKINNY_MAX_ROWS)])
def test_greedy_with_skinny_linears_matches_transformers(gamma: int, rows: tuple[int, int]) -> None:
    """The fast path decodes what transformers' greedy decodes with the plain model, ragged batch."""
    plain = tiny_llama(2, seed=0)
    target, drafter = copy.deepcopy(plain), tiny_llama(1, seed=1)
    use_skinny_linears(target, rows)
    use_skinny_linears(drafter, rows)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 64, (n,), generator=generator).tolist() for n in (3, 7, 1, 12)]
    expected = [
        plain.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, pad_token_id=0)[0, len(p) :].tolist()
        for p in prompts
    ]
    result = speculative_generate(target, drafter, prompts, gamma=gamma, max_new_tokens=20, eos_token_ids=[])
    assert result.sequences == expected
    assert (
        result.sequences[:1]
        == speculative_generate(
            target, drafter, prompts[:1], gamma=gamma, max_new_tokens=20, eos_token_ids=[]
        ).sequences
    )


@pytest.mark.parametrize("kind", ["derived", "feature", "pretrained"])
def test_drafters_follow_the_targets_kernels(kind: str, tmp_path: Path) -> None:
    """Derived and pretrained drafters take the row counts the target's skinny linears take."""
    from specdecode.models import DrafterConfig, build_drafter

    for rows in (FEW_ROWS, (1, SKINNY_MAX_ROWS), None):
        target, tokenizer = load_model("smoke", skinny_matmul=False)
        if rows is not None:
            use_skinny_linears(target, rows)
        if kind == "pretrained" and not (tmp_path / "config.json").exists():
            build_drafter(
                DrafterConfig(kind="derived", num_layers=1, draft_vocab=None), target, tokenizer, lambda: []
            ).save_pretrained(tmp_path)
            tokenizer.save_pretrained(tmp_path)
        path = str(tmp_path) if kind == "pretrained" else None
        drafter = build_drafter(
            DrafterConfig(kind=kind, num_layers=1, draft_vocab=None, path=path), target, tokenizer, lambda: []
        )
        assert skinny_rows_of(drafter) == rows
        assert all(m.skinny_rows == rows for m in drafter.modules() if isinstance(m, SkinnyLinear))


def test_cast_copy_is_a_plain_copy_in_the_new_dtype_and_leaves_the_model_alone() -> None:
    """The bf16 copy that writes training data: same weights rounded, plain linears (the skinny
    kernel was timed for the original's dtype), frozen; the original keeps its dtype and kernel."""
    model, _ = load_model("smoke", skinny_matmul=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    copy = cast_copy(model, torch.bfloat16)
    assert copy is not model and copy.dtype == torch.bfloat16 and not copy.training
    assert skinny_rows_of(copy) is None and skinny_rows_of(model) is not None
    assert not any(p.requires_grad for p in copy.parameters())
    assert all(torch.equal(v, before[k]) and v.dtype == torch.float32 for k, v in model.state_dict().items())
    assert all(torch.equal(v, before[k].to(torch.bfloat16)) for k, v in copy.state_dict().items())
    assert cast_copy(model, torch.float32) is model


def test_the_kernel_pick_is_measured_once_per_machine_and_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """`load_model(skinny_matmul=None)` times the kernels on a model's first load on this machine only: later loads read
    the pick from the cache folder (conftest's, per test), until what it depends on changes (the CPU,
    torch, the model's shapes) or its file cannot be read."""
    import specdecode.models.kernel_choice as kernel_choice

    measured = []

    def measure(model: nn.Module) -> tuple[int, int]:
        measured.append(model)
        return FEW_ROWS

    monkeypatch.setattr(kernel_choice, "measure_skinny_rows", measure)
    for _ in range(2):
        assert skinny_rows_of(load_model("smoke", skinny_matmul=None)[0]) == FEW_ROWS
    assert len(measured) == 1
    [kept] = kernel_choice.kernel_cache_dir().glob("*.json")
    kept.write_text("{not json")
    # measured again, rewritten
    assert skinny_rows_of(load_model("smoke", skinny_matmul=None)[0]) == FEW_ROWS and len(measured) == 2
    assert skinny_rows_of(load_model("smoke", skinny_matmul=None)[0]) == FEW_ROWS and len(measured) == 2
    monkeypatch.setattr(kernel_choice, "cpu_model", lambda: "another CPU")
    load_model("smoke", skinny_matmul=None)
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    load_model("smoke", skinny_matmul=None)
    kernel_choice.cached_skinny_rows(tiny_llama(1))  # other shapes
    assert len(measured) == 5


def test_a_kept_pick_reads_back_as_it_was_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every pick, None (F.linear) included, comes back from the file as `measure` returned it."""
    from specdecode.models.kernel_choice import cached_rows

    key = {"kind": "skinny", "cpu": "test"}
    for rows in (None, (1, 1), FEW_ROWS):
        first = cached_rows(key | {"rows": str(rows)}, lambda rows=rows: rows)
        again = cached_rows(key | {"rows": str(rows)}, lambda: pytest.fail("measured twice"))
        assert first == again == rows
