"""The static core's pooled buffers: compiled calls of one shape write where the first call did (so
CUDA graphs replay rather than record again), and nothing of one call leaks into the next.

`torch.compile` is stubbed out (`compiled_function` returns the step as it is): the pool is the
host-side bookkeeping around the compiled steps, and is checked here in seconds."""

from __future__ import annotations

import gc

import pytest
import torch

import specdecode.decoding.compiled
import specdecode.decoding.static
import specdecode.decoding.static_buffers
import specdecode.decoding.static_cache
from specdecode import autoregressive_generate, speculative_generate
from specdecode.decoding.static_buffers import Lease, pooled_bytes, release_static_buffers, static_buffers
from tests.models_for_tests import tiny_llama
from tests.test_static import BUDGETS, counters, drafter_of
from tests.test_verify import EAGER_LOOKUP

V = 64
KINDS = ["slice", "feature", "target alone"]


@pytest.fixture()
def target() -> torch.nn.Module:
    return tiny_llama(3, seed=0)


@pytest.fixture(autouse=True)
def uncompiled_steps(monkeypatch) -> None:
    """`compile=True` with each step run as it is: the pool, without inductor's minutes."""
    monkeypatch.setattr(specdecode.decoding.compiled, "compiled_function", lambda function, device: function)
    yield
    release_static_buffers()


def prompts_of(seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=generator).tolist() for n in (3, 7, 1, 12, 5, 9, 2, 4)]


def decode(kind: str, target, drafter, prompts, **kwargs):
    kwargs = dict(max_new_tokens=BUDGETS[: len(prompts)], eos_token_ids=[], static=True, capacity=64, **kwargs)
    if kind == "target alone":
        return autoregressive_generate(target, prompts, feature_layers=(1, -1), **kwargs)
    return speculative_generate(target, drafter, prompts, gamma=3, prompt_lookup=EAGER_LOOKUP, **kwargs)


def same_result(a, b, kind: str) -> bool:
    features = kind != "target alone" or all(torch.equal(x, y) for x, y in zip(a.features, b.features, strict=True))
    return a.sequences == b.sequences and counters(a) == counters(b) and features


@pytest.fixture()
def marked(monkeypatch) -> list[list[torch.Tensor]]:
    """Per call (a list the test appends), every tensor the call marks static, held here, so that a
    call which allocated its own buffers could not land at an earlier call's addresses."""
    calls: list[list[torch.Tensor]] = []
    record = lambda *tensors: calls[-1].extend(tensors)  # noqa: E731
    monkeypatch.setattr(specdecode.decoding.static_buffers, "mark_static", record)
    return calls


def addresses(tensors: list[torch.Tensor]) -> list[int]:
    return [tensor.data_ptr() for tensor in tensors]


@pytest.mark.parametrize("kind", KINDS)
def test_later_compiled_calls_of_one_shape_write_where_the_first_did(target, marked, kind) -> None:
    """Every buffer a compiled step writes in place (`mark_static`) is at the first call's address in
    the second."""
    drafter = drafter_of(kind, target) if kind != "target alone" else None
    for seed in (1, 2):
        marked.append([])
        decode(kind, target, drafter, prompts_of(seed), compile=True)
    first, second = (addresses(call) for call in marked)
    # the target's keys and values per layer, the token rows and two counters at least
    assert len(first) >= 2 * target.config.num_hidden_layers + 3
    assert second == first


def test_a_call_that_raises_gives_its_buffers_back(target, marked, monkeypatch) -> None:
    drafter = drafter_of("feature", target)
    marked.append([])
    decode("feature", target, drafter, prompts_of(1), compile=True)
    calls = []
    real_round = specdecode.decoding.static._round

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a round failed")
        return real_round(*args, **kwargs)

    monkeypatch.setattr(specdecode.decoding.static, "_round", failing)
    marked.append([])
    with pytest.raises(RuntimeError, match="a round failed"):
        decode("feature", target, drafter, prompts_of(2), compile=True)
    monkeypatch.setattr(specdecode.decoding.static, "_round", real_round)
    marked.append([])
    decode("feature", target, drafter, prompts_of(2), compile=True)
    assert addresses(marked[-1]) == addresses(marked[0])


@pytest.mark.parametrize("kind", KINDS)
def test_pooled_calls_return_what_fresh_calls_do_and_keep_it(target, kind) -> None:
    """Calls A, B, A of one shape, compiled (pooled buffers), each equal to the uncompiled call
    (fresh buffers), checked after all three ran: nothing returned is a view of a pooled buffer,
    and no call sees a state another left behind."""
    drafter = drafter_of(kind, target) if kind != "target alone" else None
    a, b = prompts_of(1), prompts_of(2)
    pooled = [decode(kind, target, drafter, prompts, compile=True) for prompts in (a, b, a)]
    fresh = [decode(kind, target, drafter, prompts, compile=False) for prompts in (a, b)]
    assert pooled_bytes() > 0
    for got, want in zip(pooled, [*fresh, fresh[0]]):
        assert same_result(got, want, kind)
    assert kind == "target alone" or all(result.stats.looked_up > 0 for result in pooled)


def test_sampled_pooled_calls_repeat_for_a_seed(target) -> None:
    drafter = drafter_of("feature", target)
    kwargs = dict(compile=True, temperature=1.0, seed=3)
    first, _, again = (
        decode("feature", target, drafter, p, **kwargs) for p in (prompts_of(1), prompts_of(2), prompts_of(1))
    )
    assert first.sequences == again.sequences and counters(first) == counters(again)


def test_a_model_drafting_for_itself_gets_two_sets_of_buffers(target, marked) -> None:
    """The target's and the drafter's caches are the same model's buffers of one name and shape:
    within one call they must be two sets."""
    prompts = prompts_of(1)
    marked.append([])
    pooled = decode("slice", target, target, prompts, compile=True)
    assert len(set(addresses(marked[0]))) == len(marked[0])
    assert same_result(pooled, decode("slice", target, target, prompts, compile=False), "slice")


@pytest.mark.parametrize("kind", KINDS)
def test_what_a_call_leaves_in_its_buffers_reaches_no_later_call(target, kind) -> None:
    """Masked slots are read with weight 0, and 0 · NaN is NaN: a pooled buffer must come back
    zeroed, however the last call left it. Every pooled buffer is filled with NaN (floats) or
    junk ids between two calls; the second is still the uncompiled call's."""
    drafter = drafter_of(kind, target) if kind != "target alone" else None
    decode(kind, target, drafter, prompts_of(2), compile=True)
    owners = [target] + ([drafter] if drafter is not None else [])
    with torch.inference_mode():
        for owner in owners:
            for buffers in specdecode.decoding.static_buffers._POOL[owner].values():
                for kept in buffers.values():
                    for tensor in kept:
                        tensor.fill_(float("nan") if tensor.is_floating_point() else V - 1)
    pooled = decode(kind, target, drafter, prompts_of(1), compile=True)
    assert same_result(pooled, decode(kind, target, drafter, prompts_of(1), compile=False), kind)


def test_a_model_keeps_the_buffers_of_its_latest_call_shapes(target, marked, monkeypatch) -> None:
    """With room for two call shapes: batch 1, 2, 1, 3 leaves batches 1 and 3 (2 was used least recently)."""
    monkeypatch.setattr(specdecode.decoding.static_buffers, "POOLED_SHAPES", 2)
    for batch in (1, 2, 1, 3, 1, 2):
        marked.append([])
        decode("target alone", target, None, prompts_of(1)[:batch], compile=True)
    assert addresses(marked[4]) == addresses(marked[2]) == addresses(marked[0])
    assert addresses(marked[5]) != addresses(marked[1])


def test_a_held_buffer_goes_to_no_other_call_and_comes_back_zeroed() -> None:
    owner, device = torch.nn.Linear(1, 1), torch.device("cpu")
    with static_buffers(True, (1, 4)) as one, static_buffers(True, (1, 4)) as two:
        held = one.zeros(owner, "x", (4,), torch.float32, device).fill_(7)
        other = two.zeros(owner, "x", (4,), torch.float32, device)
        assert other.data_ptr() != held.data_ptr()
    with static_buffers(True, (1, 4)) as three:
        again = three.zeros(owner, "x", (4,), torch.float32, device)
        assert again.data_ptr() in {held.data_ptr(), other.data_ptr()} and not again.any()
        assert three.zeros(owner, "x", (4,), torch.float64, device).dtype == torch.float64


def test_pooled_buffers_go_with_their_model_or_on_release() -> None:
    target = tiny_llama(3, seed=0)
    decode("target alone", target, None, prompts_of(1), compile=False)
    assert pooled_bytes() == 0  # an uncompiled call keeps nothing
    decode("target alone", target, None, prompts_of(1), compile=True)
    held = pooled_bytes()
    assert held > 0
    other = tiny_llama(3, seed=1)
    decode("target alone", other, None, prompts_of(1), compile=True)
    assert pooled_bytes() == 2 * held
    release_static_buffers(other)
    assert pooled_bytes() == held
    del target
    gc.collect()
    assert pooled_bytes() == 0


def test_a_lease_that_is_not_pooled_allocates_every_time() -> None:
    owner, lease = torch.nn.Linear(1, 1), Lease(pooled=False, shape=(1, 4))
    first = lease.zeros(owner, "x", (4,), torch.float32, torch.device("cpu"))
    assert lease.zeros(owner, "x", (4,), torch.float32, torch.device("cpu")) is not first
    assert pooled_bytes() == 0


def _tensors(objects, seen: set[int] | None = None) -> list[torch.Tensor]:
    """The tensors held by `objects`' attributes (also in lists, and in attributes' own attributes),
    models aside."""
    seen = set() if seen is None else seen
    found = []
    for obj in objects:
        if id(obj) in seen or isinstance(obj, torch.nn.Module) or not hasattr(obj, "__dict__"):
            continue
        seen.add(id(obj))
        for value in vars(obj).values():
            values = value if isinstance(value, list | tuple) else [value]
            found += [v for v in values if isinstance(v, torch.Tensor)]
            found += _tensors([v for v in values if not isinstance(v, torch.Tensor)], seen)
    return found


@pytest.mark.parametrize("kind", KINDS)
def test_every_tensor_a_step_writes_in_place_is_marked_static(target, marked, monkeypatch, kind) -> None:
    """A compiled step that writes a tensor in place which is not a static address is not captured
    as a CUDA graph (and with a new tensor each call, would not replay): every tensor a round or a
    step changes in place is one the call marked static (and so pooled)."""
    changed: dict[int, str] = {}

    def watched(function):
        def step(*args):
            before = [(tensor, tensor.clone()) for tensor in _tensors(args)]
            function(*args)
            for tensor, old in before:
                if not torch.equal(tensor, old):
                    changed[id(tensor)] = f"{tuple(tensor.shape)} {tensor.dtype}"

        return step

    monkeypatch.setattr(specdecode.decoding.compiled, "compiled_function", lambda function, device: watched(function))
    drafter = drafter_of(kind, target) if kind != "target alone" else None
    marked.append([])
    decode(kind, target, drafter, prompts_of(1), compile=True)
    static = {id(tensor) for tensor in marked[0]}
    assert changed and not {key: name for key, name in changed.items() if key not in static}
