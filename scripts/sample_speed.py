"""One sampled token per row of `[B, V]` probabilities: `sampling.sample` (the fp64 CDF at one
uniform per row) against the race of V exponentials it replaced, argmax(p / E), E ~ Exp(1).

    python scripts/sample_speed.py
"""

import time

import torch

from specdecode.decoding.sampling import sample

VOCAB = 49152  # SmolLM2's


def best_ms(function: object, repeats: int = 30) -> float:
    """The faster of two timings of `repeats` calls, in ms per call."""
    times = []
    for _ in range(2):
        function()
        start = time.perf_counter()
        for _ in range(repeats):
            function()
        times.append((time.perf_counter() - start) / repeats * 1e3)
    return min(times)


def main() -> None:
    for batch in (1, 8, 64):
        probs = torch.randn(batch, VOCAB).mul(3).softmax(-1)
        generator = torch.Generator().manual_seed(0)
        race = best_ms(lambda: (probs / torch.empty_like(probs).exponential_(generator=generator)).argmax(-1))
        cdf = best_ms(lambda: sample(probs, generator))
        print(f"B={batch} V={VOCAB}: exponential race {race:.2f} ms, fp64 CDF {cdf:.2f} ms")


if __name__ == "__main__":
    main()
