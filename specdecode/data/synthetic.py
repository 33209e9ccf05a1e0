"""The smoke experiment's synthetic domain examples (source `synthetic`): templated, seeded, no
package and no hub; its tiny target and tokenizer are `specdecode.models.smoke`."""

from __future__ import annotations

import random

from specdecode.data.example import Example

_NAMES = ("ada", "bob", "cy", "dee", "eve", "fay", "gus", "hal", "ivy", "jo")


def synthetic_examples(domain: str, count: int = 300, seed: int = 0) -> list[Example]:
    """`count` short templated prompt/response pairs of a domain, deterministic for a seed."""
    rng = random.Random(f"{domain}-{seed}")
    examples = []
    for i in range(count):
        a, b, name = rng.randint(0, 99), rng.randint(0, 99), rng.choice(_NAMES)
        if domain == "code":
            prompt, response = f"def add_{i}(x):\n    \"\"\"Add {a} to x.\"\"\"\n", f"    return x + {a}\n"
        elif domain == "math":
            prompt, response = f"Q{i}: what is {a} plus {b}?", f"{a} + {b} = {a + b}. #### {a + b}"
        else:
            prompt, response = f"[{i}] say hi to {name}", f"Hi {name}! Nice to meet you, {name}."
        examples.append(Example(prompt=prompt, response=response, domain=domain))
    return examples
