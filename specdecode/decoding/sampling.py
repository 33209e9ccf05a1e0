"""Logits → probabilities, and sampling from them: one function for drafter and target alike, since
rejection sampling is exact only if q and p are exactly what each would sample from."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdecode.core.config import TEMPERATURE_RANGE, is_int, is_temperature


@dataclass(frozen=True)
class SamplingParams:
    """How a token is drawn: temperature 0 is greedy (one-hot argmax); top_k 0 and top_p 1 disable."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not is_temperature(self.temperature):
            raise ValueError(f"temperature must be {TEMPERATURE_RANGE}, got {self.temperature!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class TensorTemperature:
    """`SamplingParams` for a compiled graph, with the temperature a 0-d fp32 tensor: dynamo compiles a
    graph per value of a Python float, and a tensor lets one graph sample at every temperature."""

    temperature: torch.Tensor
    top_k: int
    top_p: float
    greedy: bool = False

    @classmethod
    def of(cls, params: SamplingParams, device: torch.device) -> TensorTemperature:
        """`params`' temperature as a tensor on `device` (sampled params only). Dividing by it may
        round the last bit otherwise than the eager loop: sampling still follows the target."""
        if params.greedy:
            raise ValueError("TensorTemperature is for sampling; greedy params need no temperature")
        temperature = torch.tensor(params.temperature, dtype=torch.float32, device=device)
        return cls(temperature, params.top_k, params.top_p)


# The sampling settings a decode step reads: as given, or with the temperature a tensor (compiled).
Params = SamplingParams | TensorTemperature


def logits_to_probs(logits: torch.Tensor, params: Params) -> torch.Tensor:
    """Logits `[..., V]` (any float dtype, `-inf` allowed) → the fp32 distribution `[..., V]` a token
    is sampled from: temperature, top-k, top-p in that order (as transformers); one-hot when greedy."""
    # fp32 so that p(x)/q(x) and the residual max(0, p - q) are not computed from bf16 roundings.
    logits = logits.float()
    vocab_size = logits.shape[-1]
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), vocab_size).float()
    logits = logits / params.temperature
    if 0 < params.top_k < vocab_size:
        kth_largest = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the most likely token always).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= params.top_p, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits.softmax(dim=-1)


def sample_draws(shape: tuple[int, ...], device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """The draws `sample` takes for probabilities of `shape` `[..., V]`: one U(0, 1] per row,
    `[..., 1]` fp64, drawn ahead from `generator` for a compiled graph."""
    return 1.0 - torch.rand((*shape[:-1], 1), dtype=torch.float64, device=device, generator=generator)


class DrawnAhead:
    """Random numbers drawn from a seeded generator before a compiled round, passed as the
    `generator` of its `sample` and `rejection_sample` calls, which take them in the order drawn."""

    def __init__(self, draws: list[torch.Tensor]) -> None:
        self.draws = draws
        self.used = 0

    def next(self) -> torch.Tensor:
        draw = self.draws[self.used]
        self.used += 1
        return draw


Generator = torch.Generator | DrawnAhead | None


def uniform(shape: tuple[int, ...], device: torch.device, generator: Generator) -> torch.Tensor:
    """U(0, 1) draws of `shape`: the next drawn ahead, or new ones from `generator`."""
    if isinstance(generator, DrawnAhead):
        return generator.next()
    return torch.rand(shape, generator=generator, device=device)


def sample(probs: torch.Tensor, generator: Generator = None) -> torch.Tensor:
    """Draw one token per row of `probs` `[..., V]` → `[...]` int64 by inverting the CDF: the first id
    whose cumulative mass reaches u · total, u ~ U(0, 1]. The sums are fp64, so each id keeps its mass
    to fp64 rounding and an id of zero mass is never drawn; one uniform per row, where a race of
    exponentials needs V, and no host sync on CUDA (unlike `torch.multinomial`)."""
    draws = (
        generator.next() if isinstance(generator, DrawnAhead) else sample_draws(probs.shape, probs.device, generator)
    )
    cdf = probs.double().cumsum(dim=-1)
    return torch.searchsorted(cdf, draws * cdf[..., -1:]).squeeze(-1)


def next_tokens(
    logits: torch.Tensor,
    params: Params,
    generator: Generator,
) -> torch.Tensor:
    """One token per row of `logits` `[..., V]` → `[...]`: the argmax when greedy (no one-hot
    built), else a sample from `logits_to_probs`."""
    return logits.argmax(dim=-1) if params.greedy else sample(logits_to_probs(logits, params), generator)


def row_tokens(logits: torch.Tensor, temperatures: torch.Tensor, params: Params, generator: Generator) -> torch.Tensor:
    """One token per row of `logits` `[B, V]` → `[B]`, row b drawn at `temperatures[b]` `[B]` (0: its
    argmax) with `params`' top-k and top-p: several continuations of one prompt in one batch."""
    greedy = temperatures == 0
    scaled = TensorTemperature(torch.where(greedy, 1.0, temperatures).unsqueeze(-1), params.top_k, params.top_p)
    return torch.where(greedy, logits.argmax(dim=-1), sample(logits_to_probs(logits, scaled), generator))
