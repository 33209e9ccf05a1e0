"""Stub causal LMs with fixed logits, for decode tests whose outcome is known exactly."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn


class MarkovLM(nn.Module):
    """A "model" whose logits depend only on the current token: logits[b, t] = table[input_ids[b, t]].

    It speaks the slice of the transformers causal-LM interface the decode loop uses, ignores the
    cache (a Markov chain needs no history), and records every call's input shape.
    """

    def __init__(self, table: torch.Tensor, eos_token_id: int | None = None) -> None:
        super().__init__()
        self.register_buffer("table", table.float())
        vocab_size = table.shape[0]
        self.config = SimpleNamespace(
            vocab_size=vocab_size, num_hidden_layers=1, max_position_embeddings=4096, eos_token_id=eos_token_id
        )
        self.config.get_text_config = lambda: self.config
        self.generation_config = SimpleNamespace(eos_token_id=eos_token_id)
        self.input_shapes: list[tuple[int, ...]] = []

    @property
    def device(self) -> torch.device:
        return self.table.device

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def forward(self, input_ids: torch.Tensor, logits_to_keep: int | torch.Tensor = 0, **_: object) -> SimpleNamespace:
        self.input_shapes.append(tuple(input_ids.shape))
        logits = self.table[input_ids]
        if isinstance(logits_to_keep, torch.Tensor):
            logits = logits[:, logits_to_keep]
        elif logits_to_keep > 0:
            logits = logits[:, -logits_to_keep:]
        return SimpleNamespace(logits=logits)


def successor_table(vocab_size: int, step: int | list[int], sharpness: float = 10.0) -> torch.Tensor:
    """Logits `[V, V]` whose argmax after token v is (v + step[v]) % V."""
    steps = [step] * vocab_size if isinstance(step, int) else step
    table = torch.zeros(vocab_size, vocab_size)
    for v, s in enumerate(steps):
        table[v, (v + s) % vocab_size] = sharpness
    return table
