"""The compile helpers: decoder layers marked as one nested compile region (`nest_layers`), so a
compiled step traces a layer once and reuses it for every layer."""

from __future__ import annotations

import types

import pytest
import torch

import specdecode.decoding.compiled as compiled
from specdecode import autoregressive_generate, speculative_generate
from tests.models_for_tests import tiny_llama
from tests.test_feature_drafter import random_feature_drafter

needs_regions = pytest.mark.skipif(
    not hasattr(torch.compiler, "nested_compile_region"), reason="torch without nested_compile_region"
)


@needs_regions
def test_nest_layers_binds_one_region_to_each_decoder_layer_once() -> None:
    model = tiny_llama(3)
    tokens = torch.tensor([[1, 2, 3, 4]])
    before = model(tokens).logits
    assert compiled.nest_layers(model) == 3
    layers = model.model.layers
    functions = {layer.forward.__func__ for layer in layers}
    assert len(functions) == 1 and all(layer.forward.__self__ is layer for layer in layers)
    assert compiled.nest_layers(model) == 3  # idempotent: the same bound region, not wrapped twice
    assert {layer.forward.__func__ for layer in layers} == functions
    torch.testing.assert_close(model(tokens).logits, before, rtol=0, atol=0)  # eager: a no-op


@needs_regions
def test_nest_layers_leaves_replaced_forwards_and_unmarked_models_alone(monkeypatch) -> None:
    model = tiny_llama(2)
    layer = model.model.layers[0]
    hook = types.MethodType(lambda self, *args, **kwargs: type(self).forward(self, *args, **kwargs), layer)
    layer.forward = hook
    assert compiled.nest_layers(model) == 1
    assert layer.forward is hook
    assert compiled.nest_layers(random_feature_drafter(tiny_llama(2))) == 0  # no `_no_split_modules`
    monkeypatch.setattr(compiled, "NESTED_LAYERS", False)
    fresh = tiny_llama(2)
    assert compiled.nest_layers(fresh) == 0 and "forward" not in vars(fresh.model.layers[0])


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
def test_a_compiled_step_traces_every_layer_as_one_region(monkeypatch, nested: bool) -> None:
    """A compiled step of the target alone and a compiled round invoke one region per target layer,
    all the same region (traced once, reused), and decode the eager loop's tokens."""
    monkeypatch.setattr(compiled, "NESTED_LAYERS", nested)
    target = tiny_llama(3)
    prompts, kwargs = [[1, 2, 3], [4]], dict(max_new_tokens=5, eos_token_ids=[])
    eager = autoregressive_generate(target, prompts, **kwargs)

    def alone() -> None:
        assert autoregressive_generate(target, prompts, static=True, compile=True, **kwargs).sequences == (
            eager.sequences
        )

    (step,) = _invoked_regions(monkeypatch, alone)
    assert len(step) == (3 if nested else 0) and len(set(step)) == (1 if nested else 0)

    drafter = random_feature_drafter(target, feature_layers=(1, -1))

    def rounds() -> None:
        ours = speculative_generate(target, drafter, prompts, gamma=2, static=True, compile=True, **kwargs)
        assert ours.sequences == eager.sequences

    (round_,) = _invoked_regions(monkeypatch, rounds)
    assert len(round_) == (3 if nested else 0) and len(set(round_)) == (1 if nested else 0)
