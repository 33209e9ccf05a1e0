"""What `CompiledDecoder` compiles, and how: a round or a target step is one `torch.compile` graph
per shape and sampling mode (a sampled temperature is a tensor input; a seeded step takes its draws
as inputs). On CUDA each graph is a CUDA graph whose outputs the next replay overwrites, so what a
step reassigns is copied out after it (`outputs_copied`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from specdecode.core.config import is_int
from specdecode.decoding.sampling import Params, SamplingParams, TensorTemperature
from specdecode.decoding.static_cache import LayerKV

# Whether `compile=None` compiles on the CPU: off, as a step a fifth faster pays back tens of seconds
# of compiling per model and shape only after thousands of tokens (`compile=true` for long runs).
COMPILE_ON_CPU = False
# Whether compiled decodes run each model's layers as one nested region (`nested_layers`): a shorter
# first compile for a slightly slower step. Off until measured on a GPU.
NESTED_LAYERS = False
# Graphs dynamo keeps per compiled function (one per shape) before it falls back to eager; its default 8 is too few.
RECOMPILE_LIMIT = 64


def resolve_compile(setting: bool | None, device: torch.device | str) -> bool:
    """`compile` as asked (TypeError unless true, false or None), or for None: on for CUDA,
    `COMPILE_ON_CPU` on the CPU, off elsewhere."""
    if setting is not None:
        if not isinstance(setting, bool):
            raise TypeError(f"compile must be true, false or null (auto), got {setting!r}")
        return setting
    kind = torch.device(device).type
    return kind == "cuda" or (kind == "cpu" and COMPILE_ON_CPU)


def check_core(static: object, compile: object, device: torch.device, capacity: object = None) -> bool:
    """Check the decode entry points' `static` / `compile` / `capacity` options; return whether to compile."""
    if not isinstance(static, bool):
        raise TypeError(f"static must be true or false, got {static!r}")
    on = resolve_compile(compile, device)  # type: ignore[arg-type]  # a bad value is named inside
    if compile is True and not static:
        raise ValueError("compile=True needs static=True: only the static-shape core can be compiled")
    if capacity is not None and (not is_int(capacity) or capacity < 1):
        raise TypeError(f"capacity must be a positive int (cache slots per row) or None, got {capacity!r}")
    if capacity is not None and not static:
        raise ValueError(f"capacity={capacity!r} needs static=True: the eager loop sizes its caches per call")
    if static and on and not hasattr(getattr(torch.compiler, "config", None), "recompile_limit"):
        raise RuntimeError(
            f"compile=True needs torch >= 2.7 (torch.compiler.config); this is torch {torch.__version__}"
        )
    return static and on


# The compiled wrapper of each function, per mode.
_COMPILED_FUNCTIONS: dict[tuple[Callable, str | None], Callable] = {}


def _compile(target: Callable, device: torch.device) -> Callable:
    config = torch.compiler.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    # "reduce-overhead" is these options' CUDA graphs; rounding as eager does between fused ops keeps
    # bf16 passes of other widths from parting at near-ties more often than eager ones do
    options: dict[str, str | int | bool | Callable[..., Any]] = {
        "triton.cudagraphs": _mode(device) == "reduce-overhead",
        "emulate_precision_casts": True,
    }
    return torch.compile(target, options=options, dynamic=False)


def graphs_compiled() -> int:
    """How many graphs dynamo has compiled in this process so far: a call that raised it compiled."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _mode(device: torch.device) -> str | None:
    """The `torch.compile` mode the options above amount to: CUDA graphs on CUDA."""
    return "reduce-overhead" if device.type == "cuda" else None


def compiled_function(function: Callable, device: torch.device) -> Callable:
    """`function` under `torch.compile` (module docstring), built once per function and mode."""
    key = (function, _mode(device))
    if key not in _COMPILED_FUNCTIONS:
        _COMPILED_FUNCTIONS[key] = _compile(function, device)
    return _COMPILED_FUNCTIONS[key]


def compiled_for(function: Callable, params: SamplingParams, device: torch.device) -> tuple[Callable, Params]:
    """A step `function` compiled, and its sampling params (a sampled temperature as a tensor)."""
    return compiled_function(function, device), params if params.greedy else TensorTemperature.of(params, device)


# The nested compile region of each decoder layer forward function.
_REGIONS: dict[Callable, Callable] = {}
# the attribute `nested_layers` gives a marked layer: its index, which picks its buffers in the cache
_LAYER_INDEX = "_specdecode_layer_index"


def _region(forward: Callable) -> Callable | None:
    """A decoder layer class's `forward` that, given a static cache, runs the layer as a nested
    compile region taking its buffers as tensors (a region taking the cache would bake the layer's
    index into a trace reused for every layer). None for a `forward` without a known cache keyword."""
    if forward not in _REGIONS:
        parameters = inspect.signature(forward).parameters
        keyword = next((name for name in ("cache", "past_key_values") if name in parameters), None)
        if keyword is None:
            return None

        def in_region(
            self: torch.nn.Module,
            hidden_states: torch.Tensor,
            keys: torch.Tensor,
            values: torch.Tensor,
            slots: torch.Tensor,
            **kwargs: object,
        ) -> object:
            return forward(self, hidden_states, **{keyword: LayerKV(keys, values, slots)}, **kwargs)

        region = torch.compiler.nested_compile_region(in_region)

        def layer_forward(self: torch.nn.Module, *args: object, **kwargs: object) -> object:
            cache = kwargs.get(keyword)
            buffers = cache.layer_buffers(getattr(self, _LAYER_INDEX)) if hasattr(cache, "layer_buffers") else None
            if buffers is None or len(args) + ("hidden_states" in kwargs) != 1:
                return forward(self, *args, **kwargs)
            kwargs = {k: v for k, v in kwargs.items() if k != keyword}
            hidden_states = args[0] if args else kwargs.pop("hidden_states")
            return region(self, hidden_states, *buffers, **kwargs)

        _REGIONS[forward] = functools.update_wrapper(layer_forward, forward)
    return _REGIONS[forward]


def _layer_index(layer: torch.nn.Module) -> int | None:
    """The index a decoder layer's attention passes to its cache (`layer_idx`), or None."""
    indices = (getattr(m, "layer_idx", None) for m in layer.modules())
    return next((i for i in indices if isinstance(i, int)), None)


@contextlib.contextmanager
def nested_layers(*models: torch.nn.Module) -> Iterator[int]:
    """Within the block, the decoder layers of `models` (the classes `_no_split_modules` names) run
    as one nested compile region, compiled once for every layer. Models whose layers differ by type
    are left alone. Yields how many layers it marked (none where `NESTED_LAYERS` is off)."""
    marked = []
    try:  # marking inside: a layer marked before an error while marking the next is unmarked too
        if NESTED_LAYERS and hasattr(torch.compiler, "nested_compile_region"):
            for model in models:
                classes = set(getattr(model, "_no_split_modules", None) or ())
                if len(set(getattr(getattr(model, "config", None), "layer_types", None) or ())) > 1:
                    continue  # layers of one class that differ (sliding and full attention): not one trace
                for module in model.modules() if classes else ():
                    index = _layer_index(module) if type(module).__name__ in classes else None
                    region = _region(type(module).forward) if index is not None else None
                    if region is not None and "forward" not in vars(module):
                        module.forward = types.MethodType(region, module)
                        setattr(module, _LAYER_INDEX, index)
                        marked.append(module)
        yield len(marked)
    finally:
        for module in marked:
            del module.forward
            delattr(module, _LAYER_INDEX)


@contextlib.contextmanager
def outputs_copied(*objects: object) -> Iterator[None]:
    """On leaving the block (a compiled step), every tensor attribute of `objects` it reassigned is
    copied: its outputs live in memory the next CUDA graph replay overwrites."""
    before = [dict(vars(obj)) for obj in objects]
    yield
    for obj, attributes in zip(objects, before):
        for name, value in vars(obj).items():
            if isinstance(value, torch.Tensor) and value is not attributes.get(name):
                setattr(obj, name, value.clone())


def eager_passes(compile: bool) -> contextlib.AbstractContextManager[None]:
    """Run compiled models eagerly (when compiling): for the prefills, whose widths the prompts set."""
    return torch.compiler.set_stance("force_eager") if compile else contextlib.nullcontext()


def skipped_guards(skip: bool) -> contextlib.AbstractContextManager[None]:
    """Within `skip`, compiled functions run without evaluating their guards (0.3–0.5 ms of host time
    per step of a 30-layer model): once a call's first steps ran guarded, later ones differ only in values."""
    return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True) if skip else contextlib.nullcontext()


def mark_step(compile: bool, device: torch.device) -> None:
    """Tell CUDA graph trees a decode step starts: the step before's outputs may be overwritten."""
    if compile and device.type == "cuda":
        torch.compiler.cudagraph_mark_step_begin()
