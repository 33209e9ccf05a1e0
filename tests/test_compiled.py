"""The compile helpers: decoder layers run as one nested compile region within a compiled decode
(`nested_layers`), so inductor compiles a layer once for every layer, and the models come out as
they went in."""

from __future__ import annotations

import inspect
import io
import types

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import specdecode.decoding.compiled as compiled
from specdecode import autoregressive_generate, speculative_generate
from specdecode.decoding.cache import cached_forward
from specdecode.decoding.static_cache import StaticKVCache
from specdecode.models import derive_drafter
from tests.models_for_tests import tiny_llama
from tests.test_feature_drafter import random_feature_drafter

needs_regions = pytest.mark.skipif(
    not hasattr(torch.compiler, "nested_compile_region"), reason="nested layer regions need nested_compile_region"
)


@pytest.fixture
def nesting(monkeypatch) -> None:
    """`NESTED_LAYERS` on (off by default)."""
    monkeypatch.setattr(compiled, "NESTED_LAYERS", True)


@needs_regions
def test_nested_layers_binds_one_region_to_each_layer_within_the_block_only(nesting) -> None:
    model = tiny_llama(3)
    tokens = torch.tensor([[1, 2, 3, 4]])
    before = model(tokens).logits
    layers = model.model.layers
    signature = inspect.signature(layers[0].forward)
    attributes = [set(vars(layer)) for layer in layers]
    with compiled.nested_layers(model) as marked:
        assert marked == 3
        assert len({layer.forward.__func__ for layer in layers}) == 1
        assert all(layer.forward.__self__ is layer for layer in layers)
        assert inspect.signature(layers[0].forward) == signature
        torch.testing.assert_close(model(tokens).logits, before, rtol=0, atol=0)  # eager: a no-op
    assert [set(vars(layer)) for layer in layers] == attributes  # no forward, no layer index left
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    torch.testing.assert_close(torch.load(buffer, weights_only=False)(tokens).logits, before, rtol=0, atol=0)


@needs_regions
def test_nested_layers_leaves_replaced_forwards_and_unmarked_models_alone(nesting, monkeypatch) -> None:
    model = tiny_llama(2)
    layer = model.model.layers[0]
    hook = types.MethodType(lambda self, *args, **kwargs: type(self).forward(self, *args, **kwargs), layer)
    layer.forward = hook
    with compiled.nested_layers(model, random_feature_drafter(tiny_llama(2))) as marked:
        assert marked == 1  # the other layer; a feature drafter declares no `_no_split_modules`
        assert layer.forward is hook
    assert layer.forward is hook and "forward" not in vars(model.model.layers[1])
    monkeypatch.setattr(compiled, "NESTED_LAYERS", False)
    with compiled.nested_layers(model) as marked:
        assert marked == 0 and "forward" not in vars(model.model.layers[1])


@needs_regions
def test_an_error_while_marking_unmarks_the_layers_marked_before_it(nesting, monkeypatch) -> None:
    model = tiny_llama(2)
    attributes = [set(vars(layer)) for layer in model.model.layers]
    calls, region = [], compiled._region

    def region_then_error(forward: object) -> object:
        calls.append(forward)
        if len(calls) == 2:
            raise RuntimeError("no region for the second layer")
        return region(forward)

    monkeypatch.setattr(compiled, "_region", region_then_error)
    with pytest.raises(RuntimeError, match="second layer"):
        with compiled.nested_layers(model):
            pass
    assert [set(vars(layer)) for layer in model.model.layers] == attributes


@needs_regions
def test_a_model_whose_layers_differ_by_type_is_not_nested(nesting) -> None:
    """Sliding-window and full-attention layers of one class would share one trace: such a model is
    left as it is; one whose layers are all alike is nested."""
    config = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    config.update(num_hidden_layers=3, head_dim=8, sliding_window=8, max_window_layers=1)
    mixed = Qwen3ForCausalLM(Qwen3Config(**config, use_sliding_window=True))
    alike = Qwen3ForCausalLM(Qwen3Config(**config, use_sliding_window=False))
    with compiled.nested_layers(mixed, alike) as marked:
        assert marked == 3 and all("forward" in vars(layer) for layer in alike.model.layers)


def _invoked_regions(monkeypatch, run) -> list[list[str]]:
    """The nested regions each graph dynamo captures for `run()` invokes, by identifier (the
    graphs recorded, not compiled)."""
    graphs = []

    def record(gm: torch.fx.GraphModule, example_inputs) -> object:
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(compiled, "_COMPILED_FUNCTIONS", {})
    monkeypatch.setattr(compiled, "_compile", lambda f, d: torch.compile(f, backend=record, dynamic=False))
    run()
    invoke = torch.ops.higher_order.invoke_subgraph
    return [[str(n.args[1]) for n in gm.graph.nodes if n.target is invoke] for gm in graphs]


@needs_regions
@pytest.mark.parametrize("nested", [True, False])
def test_a_compiled_step_and_round_invoke_one_region_per_layer(monkeypatch, nested: bool) -> None:
    """A compiled step of the target alone and a compiled round invoke one region per target layer,
    all the same region, and decode the eager loop's tokens; a second call compiles nothing."""
    monkeypatch.setattr(compiled, "NESTED_LAYERS", nested)
    target = tiny_llama(3)
    prompts, kwargs = [[1, 2, 3], [4]], dict(max_new_tokens=5, eos_token_ids=[])
    eager = autoregressive_generate(target, prompts, **kwargs)
    drafter = random_feature_drafter(target, feature_layers=(1, -1))

    def alone() -> None:
        for stance in ("default", "fail_on_recompile"):
            with torch.compiler.set_stance(stance):
                ours = autoregressive_generate(target, prompts, static=True, compile=True, **kwargs)
            assert ours.sequences == eager.sequences

    def rounds() -> None:
        for stance in ("default", "fail_on_recompile"):
            with torch.compiler.set_stance(stance):
                ours = speculative_generate(target, drafter, prompts, gamma=2, static=True, compile=True, **kwargs)
            assert ours.sequences == eager.sequences

    for run in (alone, rounds):
        (invoked,) = _invoked_regions(monkeypatch, run)
        assert len(invoked) == (3 if nested else 0) and len(set(invoked)) == (1 if nested else 0)
    assert not any("forward" in vars(layer) for layer in target.model.layers)


@needs_regions
def test_a_slice_drafters_layers_are_regions_too(nesting, monkeypatch) -> None:
    target = tiny_llama(3)
    drafter = derive_drafter(target, 2)
    prompts, kwargs = [[1, 2, 3], [4]], dict(max_new_tokens=6, eos_token_ids=[], gamma=2)
    eager = speculative_generate(target, drafter, prompts, **kwargs)

    def rounds() -> None:
        assert speculative_generate(target, drafter, prompts, static=True, compile=True, **kwargs).sequences == (
            eager.sequences
        )

    (invoked,) = _invoked_regions(monkeypatch, rounds)
    assert len(invoked) == 3 + 2 * 2  # the target's 3 layers, and the drafter's 2 in each of its 2 passes


@needs_regions
def test_a_layers_region_writes_the_buffers_it_is_given_not_those_its_layer_index_picks(nesting) -> None:
    """A region takes its layer's KV buffers as tensors, so one trace serves every layer: the index the
    layer's attention passes to the cache (a constant of the trace that torch 2.14 reuses for the next
    layer) picks nothing. With it made wrong, the layer still writes its own buffers, as eagerly."""
    model = tiny_llama(2)
    tokens = torch.tensor([[1, 2, 3, 4]])
    cache = StaticKVCache.for_model(model, 1, 16)
    cached_forward(model, cache, tokens)  # the prefill allocates both layers' buffers
    expected = cached_forward(model, cache, torch.tensor([[5]]))
    keys = [k.clone() for k in cache.keys]
    cache.set_lengths(torch.tensor([4]))
    for k, v in zip(cache.keys, cache.values):
        k[:, :, 4:].zero_(), v[:, :, 4:].zero_()
    with compiled.nested_layers(model) as marked:
        assert marked == 2
        model.model.layers[1].self_attn.layer_idx = 0
        try:
            torch.testing.assert_close(cached_forward(model, cache, torch.tensor([[5]])), expected, rtol=0, atol=0)
        finally:
            model.model.layers[1].self_attn.layer_idx = 1
    for k, before in zip(cache.keys, keys):
        torch.testing.assert_close(k, before, rtol=0, atol=0)


def test_outputs_copied_replaces_reassigned_tensors_and_keeps_those_written_in_place() -> None:
    """A compiled step's outputs live in its CUDA graph's memory: what the step reassigns comes out a
    copy (same values, another tensor); what it writes in place stays where it is (a static buffer)."""
    state = types.SimpleNamespace(lengths=torch.tensor([1, 2]), buffer=torch.zeros(2), label="rows")
    buffer, returned = state.buffer, []
    with compiled.outputs_copied(state):
        state.lengths = state.lengths + 1
        state.buffer.add_(1)
        returned.append(state.lengths)
    assert state.lengths is not returned[0] and state.lengths.tolist() == [2, 3]
    assert state.buffer is buffer and state.buffer.tolist() == [1.0, 1.0] and state.label == "rows"


def test_both_caches_are_one_kv_cache_and_allocate_state_beside_them() -> None:
    """The ragged and static caches share the declared `KVCache`, and `buffer` takes state from the
    cache's own `zeros` (the static decoder's pool), by name."""
    from specdecode.decoding.cache import KVCache, RaggedKVCache

    model, asked = tiny_llama(2, seed=0), []

    def zeros(name, shape, dtype, device):
        asked.append(name)
        return torch.zeros(shape, dtype=dtype, device=device)

    for kind in (RaggedKVCache, StaticKVCache):
        cache = kind.for_model(model, 2, 16, zeros)
        assert isinstance(cache, KVCache) and cache.batch_size == 2
        assert cache.buffer("drafting.features", (2, 16, 3), torch.float32).shape == (2, 16, 3)
        cached_forward(model, cache, torch.tensor([[1, 2], [3, 4]]))
        assert cache.lengths.tolist() == [2, 2]
    assert asked.count("drafting.features") == 2 and asked.count("kv.0.keys") == 2
