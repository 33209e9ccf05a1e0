"""The static-shape core and its compiled steps on a CUDA device (`mode="reduce-overhead"`: CUDA
graphs): token for token transformers' greedy there, on a ragged batch with slice and feature
drafters at gamma 1 and 4, the data writer's features, bf16 greedy against target-alone greedy in
bf16, no recompiling on a second call of the same shapes, every compiled graph captured as a
CUDA graph, and the same with decoder layers as nested compile regions.

Marked `gpu` (`make test-gpu`) and skipped without CUDA; `SPECDECODE_GPU_TEST_DEVICE=cpu` runs
them on the CPU (slowly: inductor compiles each shape there for seconds).
"""

from __future__ import annotations

import os

import pytest
import torch

from specdecode import autoregressive_generate, speculative_generate
from specdecode.models import derive_drafter
from tests.models_for_tests import tiny_llama
from tests.test_feature_drafter import hf_greedy, random_feature_drafter

DEVICE = os.environ.get("SPECDECODE_GPU_TEST_DEVICE", "cuda")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(autouse=True)
def cuda_graphs_or_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA a compiled step that inductor cannot capture as a CUDA graph (a mutated input that is
    not a static address, a CPU tensor, ...) fails the test instead of silently running kernel by kernel."""
    if DEVICE.startswith("cuda"):
        monkeypatch.setattr(torch._inductor.config.triton, "cudagraph_or_error", True)


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(3, seed=0).to(DEVICE)


@pytest.mark.parametrize("compile", [False, True], ids=["static", "compiled"])
@pytest.mark.parametrize("kind", ["slice", "feature"])
def test_static_core_is_exact_on_the_device(target, ragged_prompts, kind: str, compile: bool) -> None:
    drafter = derive_drafter(target, 1) if kind == "slice" else random_feature_drafter(target, feature_layers=(1, -1))
    expected = [hf_greedy(target, p, 20) for p in ragged_prompts]
    for gamma in (1, 4):
        kwargs = dict(gamma=gamma, max_new_tokens=20, eos_token_ids=[], static=True, compile=compile)
        batched = speculative_generate(target, drafter, ragged_prompts, **kwargs)
        single = speculative_generate(target, drafter, ragged_prompts[3:4], **kwargs)
        assert batched.sequences == expected and single.sequences == expected[3:4]
        assert 0 < batched.stats.accepted < batched.stats.drafted
        with torch.compiler.set_stance("fail_on_recompile" if compile else "default"):
            assert speculative_generate(target, drafter, ragged_prompts, **kwargs).sequences == expected
    alone = autoregressive_generate(
        target, ragged_prompts, max_new_tokens=20, eos_token_ids=[], static=True, compile=compile
    )
    assert alone.sequences == expected


@pytest.mark.parametrize("compile", [False, True], ids=["static", "compiled"])
def test_data_writer_features_on_the_device(target, ragged_prompts, compile: bool) -> None:
    budgets = [9, 0, 14, 5, 11, 1, 8, 12]
    eager = autoregressive_generate(
        target, ragged_prompts, max_new_tokens=budgets, eos_token_ids=[], feature_layers=(1, -1)
    )
    ours = autoregressive_generate(
        target,
        ragged_prompts,
        max_new_tokens=budgets,
        eos_token_ids=[],
        feature_layers=(1, -1),
        static=True,
        compile=compile,
    )
    assert ours.sequences == eager.sequences
    for a, b in zip(ours.features, eager.features):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("compile", [False, True], ids=["static", "compiled"])
def test_bf16_greedy_equals_target_alone_in_bf16_on_the_device(ragged_prompts, compile: bool) -> None:
    """What exact means in bf16: equal to target-alone greedy in bf16 on the same batch and core,
    up to near-ties. Static: every row. Compiled: the one-token and the verify graphs are fused and
    round differently, and on the CPU a row of this tiny model whose top two logits are 0.18 apart
    (fp32) flipped; so at least 6 rows of 8, and the benchmark measures the rate on real models."""
    target = tiny_llama(3, seed=0).to(DEVICE, torch.bfloat16)
    drafter = random_feature_drafter(target, feature_layers=(1, -1))
    alone = autoregressive_generate(
        target, ragged_prompts, max_new_tokens=16, eos_token_ids=[], static=True, compile=compile
    )
    for gamma in (1, 4):
        ours = speculative_generate(
            target,
            drafter,
            ragged_prompts,
            gamma=gamma,
            max_new_tokens=16,
            eos_token_ids=[],
            static=True,
            compile=compile,
        )
        exact = sum(a == b for a, b in zip(ours.sequences, alone.sequences, strict=True))
        assert exact == len(ragged_prompts) if not compile else exact >= 6


@pytest.mark.skipif(not hasattr(torch.compiler, "nested_compile_region"), reason="needs nested_compile_region")
def test_nested_layer_regions_are_exact_on_the_device(target, ragged_prompts, monkeypatch) -> None:
    """With each model's layers one nested region (`compiled.NESTED_LAYERS`), writing its layer's KV
    buffers in place: transformers' greedy tokens with both drafter kinds and the target alone, every
    graph captured as a CUDA graph (the fixture above), and no recompiling on a second call."""
    import contextlib

    import specdecode.decoding.compiled as compiled
    import specdecode.decoding.static as static

    monkeypatch.setattr(compiled, "NESTED_LAYERS", True)
    marked = []

    @contextlib.contextmanager
    def counted(*models: torch.nn.Module):
        with compiled.nested_layers(*models) as count:
            marked.append(count)
            yield count

    monkeypatch.setattr(static, "nested_layers", counted)
    expected = [hf_greedy(target, p, 20) for p in ragged_prompts]
    kwargs = dict(max_new_tokens=20, eos_token_ids=[], static=True, compile=True)
    for drafter in (derive_drafter(target, 1), random_feature_drafter(target, feature_layers=(1, -1))):
        assert speculative_generate(target, drafter, ragged_prompts, gamma=2, **kwargs).sequences == expected
        with torch.compiler.set_stance("fail_on_recompile"):
            assert speculative_generate(target, drafter, ragged_prompts, gamma=2, **kwargs).sequences == expected
    assert autoregressive_generate(target, ragged_prompts, **kwargs).sequences == expected
    assert marked and min(marked) >= 3  # the target's layers were regions in every call


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="CUDA graphs are recorded on CUDA only")
def test_later_calls_of_one_shape_replay_their_cuda_graphs_without_recording_again(target, monkeypatch) -> None:
    """CUDA graph trees record a graph again wherever a static input (KV caches, token rows) moved.
    After the first two calls (compile, record), calls of one shape and capacity must replay what
    was recorded (`static_buffers`), or every call pays a capture. Every buffer marked static is
    held here, so that a call which allocated its own could not land at the last one's address."""
    from torch._inductor import cudagraph_trees

    import specdecode.decoding.static_buffers

    held = []
    mark = specdecode.decoding.static_buffers.mark_static
    monkeypatch.setattr(
        specdecode.decoding.static_buffers, "mark_static", lambda *tensors: held.extend(tensors) or mark(*tensors)
    )

    recorded = []
    record_function = cudagraph_trees.CUDAGraphTreeManager.record_function
    monkeypatch.setattr(
        cudagraph_trees.CUDAGraphTreeManager,
        "record_function",
        lambda self, *args, **kwargs: recorded.append(1) or record_function(self, *args, **kwargs),
    )
    drafter = random_feature_drafter(target, feature_layers=(1, -1))
    kwargs = dict(max_new_tokens=12, eos_token_ids=[], static=True, compile=True, capacity=64)
    counts = []
    for prompts in ([[1, 2, 3]], [[4, 5, 6, 7, 8]], [[9, 10]], [[11, 12, 13, 14]]):
        speculative_generate(target, drafter, prompts, gamma=2, **kwargs)
        autoregressive_generate(target, prompts, **kwargs)
        counts.append(len(recorded))
    assert counts[1] == counts[-1], f"graphs recorded after each call: {counts}"
