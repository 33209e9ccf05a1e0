"""Router labels: how well each drafter would do on each prompt, measured without sampling noise.
The target writes its greedy continuation once; one teacher-forced pass per model gives p and q
at every position. `acceptance` is the mean of Σ_v min(p, q) (Leviathan et al. 2023; temperature 0
scores the temperature-1 distributions), `speedup` what Leviathan's model predicts from it (what
the router ranks by), `decode_tau` / `decode_speedup` greedy decoding simulated exactly from the
same passes (`routing.simulate`; what the oracle picks by). JSON lines, one prompt a line, with a
`<name>.meta.json` sidecar: the drafters, their cost ratios, gammas and verify ratios.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from specdecode.data.example import Example
from specdecode.data.files import json_objects
from specdecode.decoding.decode import autoregressive_generate
from specdecode.decoding.lookup import PromptLookup, lookup_logits
from specdecode.decoding.speedup import predicted_speedup
from specdecode.models.compat import check_vocab_sizes
from specdecode.models.feature_drafter import FeatureDrafter, target_features
from specdecode.routing.simulate import draft_matches, simulated_tau
from specdecode.training.losses import expected_acceptance

LABEL_KEYS = ("acceptance", "greedy_match", "speedup")


@dataclass
class Labels:
    """Teacher-forced labels of N prompts for K drafters: `[N, K]` acceptance, greedy_match and
    decode_tau (None: not simulated); the target's greedy continuation per prompt."""

    drafters: list[str]
    acceptance: torch.Tensor
    greedy_match: torch.Tensor
    continuations: list[list[int]]
    decode_tau: torch.Tensor | None = None


def meta_path(labels_path: str | Path) -> Path:
    """`labels.jsonl` → `labels.meta.json`, the labels' sidecar."""
    path = Path(labels_path)
    return path.with_name(path.name.removesuffix(".jsonl") + ".meta.json")


@torch.inference_mode()
def teacher_forced_acceptance(
    target: PreTrainedModel,
    drafters: Sequence[PreTrainedModel | FeatureDrafter],
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    *,
    temperature: float = 0.0,
    lookup: PromptLookup | None = None,
    gammas: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-prompt `(acceptance, greedy_match, decode_tau)`, each `[B, K]` fp32, of K drafters along B
    given continuations, one pass per model. Prompts left-padded and continuations right-padded put
    every scored position in one `logits_to_keep` slice (`[B, C, V]`, never `[B, T, V]`). `gammas`
    (one per drafter) also simulate greedy decoding (temperature 0 only; else decode_tau is None).
    """
    if len(prompts) != len(continuations):
        raise ValueError(f"got {len(prompts)} prompts but {len(continuations)} continuations")
    if any(len(p) == 0 for p in prompts) or any(len(c) == 0 for c in continuations):
        raise ValueError("every prompt and every continuation needs at least one token")
    if gammas is not None and (len(gammas) != len(drafters) or not all(isinstance(g, int) and g >= 1 for g in gammas)):
        raise ValueError(f"gammas={list(gammas)}: one int >= 1 per drafter ({len(drafters)})")
    simulate = gammas is not None and temperature == 0
    tokens, attention, position_ids, scored, keep = _pack(prompts, continuations, target.device)

    reads_features = any(isinstance(d, FeatureDrafter) for d in drafters)
    out = target(
        input_ids=tokens,
        attention_mask=attention,
        position_ids=position_ids,
        logits_to_keep=keep,
        output_hidden_states=reads_features,
    )
    p_logits = out.logits  # [B, C, V]
    p_argmax = p_logits.argmax(-1)

    def logits_of(drafter: PreTrainedModel | FeatureDrafter, features: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(drafter, FeatureDrafter) or features is None:
            return drafter(
                input_ids=tokens, attention_mask=attention, position_ids=position_ids, logits_to_keep=keep
            ).logits
        # A feature drafter predicts token t + 1 at its position t - 1, from the target's feature there and token t.
        hidden = drafter(
            features[:, :-1], tokens[:, 1:], attention_mask=attention[:, :-1], position_ids=position_ids[:, :-1]
        )
        return drafter.logits(hidden[:, keep - 1])

    acceptance, greedy, tau = [], [], []
    for k, drafter in enumerate(drafters):
        features = (
            target_features(target, out.hidden_states, drafter.feature_layers)
            if isinstance(drafter, FeatureDrafter)
            else None
        )
        q_logits = logits_of(drafter, features)
        if simulate:
            matches = draft_matches(
                drafter,
                tokens,
                attention,
                keep,
                p_argmax,
                (gammas or [])[k],
                features=features,
                first_logits=q_logits,
                lookup=lookup if lookup is not None and lookup.applies(0.0) else None,
            )
            tau.append(simulated_tau(matches, scored.sum(1)))
        if lookup is not None and lookup.applies(temperature):
            q_logits = lookup_logits(q_logits, tokens, attention, keep, lookup)
        # Row by row through the training job's metric, so the labels are the number it reports.
        per_row = zip(q_logits.split(1), p_logits.split(1), scored.split(1))
        acceptance.append(torch.stack([expected_acceptance(q, p, s, temperature=temperature) for q, p, s in per_row]))
        match = (q_logits.argmax(-1) == p_argmax) & scored
        greedy.append(match.sum(1) / scored.sum(1))
    decode_tau = torch.stack(tau, dim=1).float() if simulate else None
    return torch.stack(acceptance, dim=1).float().cpu(), torch.stack(greedy, dim=1).float().cpu(), decode_tau


def _pack(
    prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts left-padded and continuations right-padded: `(tokens, attention_mask, position_ids)`,
    each `[B, P + C]`; `scored` `[B, C]`, the real continuation positions; `keep` `[C]`, the
    columns whose logits predict them."""
    batch = len(prompts)
    prompt_width = max(len(p) for p in prompts)
    width = max(len(c) for c in continuations)
    tokens = torch.zeros(batch, prompt_width + width, dtype=torch.long)
    attention = torch.zeros(batch, prompt_width + width, dtype=torch.long)
    scored = torch.zeros(batch, width, dtype=torch.bool)
    for b, (prompt, continuation) in enumerate(zip(prompts, continuations)):
        start = prompt_width - len(prompt)
        tokens[b, start:prompt_width] = torch.tensor(list(prompt))
        tokens[b, prompt_width : prompt_width + len(continuation)] = torch.tensor(list(continuation))
        attention[b, start : prompt_width + len(continuation)] = 1
        scored[b, : len(continuation)] = True
    tokens, attention, scored = tokens.to(device), attention.to(device), scored.to(device)
    # Positions count real tokens only, so a left-padded row sees the positions it would alone.
    position_ids = (attention.cumsum(1) - 1).clamp_min(0)
    # Logits at column t predict token t + 1: columns prompt_width - 1 .. prompt_width + width - 2.
    keep = torch.arange(prompt_width - 1, prompt_width + width - 1, device=device)
    return tokens, attention, position_ids, scored, keep


def collect_labels(
    target: PreTrainedModel,
    drafters: Sequence[tuple[str, PreTrainedModel | FeatureDrafter]],
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_token_ids: Sequence[int] | int | None = None,
    batch_size: int = 8,
    progress: bool = True,
    lookup: PromptLookup | None = None,
    gammas: Sequence[int] | None = None,
) -> Labels:
    """The target's greedy continuations of `prompts` and every drafter's acceptance along them
    (`teacher_forced_acceptance`), in batches sorted by length, returned in the caller's order."""
    if not prompts:
        raise ValueError("prompts is empty: nothing to label")
    if len(drafters) < 1:
        raise ValueError("need at least one (name, drafter) pair")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    for name, drafter in drafters:
        try:
            check_vocab_sizes(target, drafter)
        except ValueError as error:
            raise ValueError(f"drafter {name!r}: {error}") from None
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    acceptance = torch.zeros(len(prompts), len(drafters))
    greedy = torch.zeros(len(prompts), len(drafters))
    simulate = gammas is not None and temperature == 0
    decode_tau = torch.zeros(len(prompts), len(drafters)) if simulate else None
    continuations: list[list[int]] = [[] for _ in prompts]
    models = [drafter for _, drafter in drafters]
    for start in tqdm(range(0, len(order), batch_size), desc="labels", unit="batch", disable=not progress):
        rows = order[start : start + batch_size]
        batch = [list(prompts[i]) for i in rows]
        generated = autoregressive_generate(target, batch, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids)
        a, g, t = teacher_forced_acceptance(
            target, models, batch, generated.sequences, temperature=temperature, lookup=lookup, gammas=gammas
        )
        acceptance[rows], greedy[rows] = a, g
        if decode_tau is not None and t is not None:
            decode_tau[rows] = t
        for i, sequence in zip(rows, generated.sequences):
            continuations[i] = sequence
    return Labels([name for name, _ in drafters], acceptance, greedy, continuations, decode_tau)


def speedups(
    alpha: torch.Tensor, gammas: Sequence[int], cost_ratios: Sequence[float], verify_ratios: Sequence[float]
) -> torch.Tensor:
    """Leviathan Thm 3.8 (measured verify cost) per prompt and drafter: `[N, K]` alpha → `[N, K]`,
    drafter k priced at its own `gammas[k]`, `cost_ratios[k]` and `verify_ratios[k]` (at that gamma)."""
    if not alpha.shape[1] == len(gammas) == len(cost_ratios) == len(verify_ratios):
        raise ValueError(
            f"alpha has {alpha.shape[1]} drafter columns but {len(gammas)} gammas, {len(cost_ratios)} cost ratios "
            f"and {len(verify_ratios)} verify ratios were given"
        )
    return torch.tensor(
        [
            [
                predicted_speedup(min(max(a, 0.0), 1.0), g, c, v)
                for a, g, c, v in zip(row, gammas, cost_ratios, verify_ratios)
            ]
            for row in alpha.tolist()
        ]
    )


def label_rows(
    labels: Labels,
    examples: Sequence[tuple[str, Example]],
    prompt_tokens: Sequence[int],
    *,
    gammas: Sequence[int],
    cost_ratios: Sequence[float],
    verify_ratios: Sequence[float],
) -> list[dict[str, Any]]:
    """One JSON-ready dict per prompt: text, domain, split, token counts and per-drafter labels."""
    columns = {
        "acceptance": labels.acceptance,
        "greedy_match": labels.greedy_match,
        "speedup": speedups(labels.acceptance, gammas, cost_ratios, verify_ratios),
    }
    if labels.decode_tau is not None:
        # tokens per call over a pass's cost in target steps: as the evaluation's oracle ranks runs
        pass_costs = torch.tensor([v + g * c for g, c, v in zip(gammas, cost_ratios, verify_ratios)])
        columns |= {"decode_tau": labels.decode_tau, "decode_speedup": labels.decode_tau / pass_costs}
    rows = []
    for i, (split, example) in enumerate(examples):
        row: dict[str, Any] = {
            "prompt": example.prompt,
            "domain": example.domain,
            "split": split,
            "prompt_tokens": prompt_tokens[i],
            "continuation_tokens": len(labels.continuations[i]),
        }
        for key, values in columns.items():
            row[key] = {name: round(float(v), 6) for name, v in zip(labels.drafters, values[i].tolist())}
        rows.append(row)
    return rows


def read_labels(path: str | Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rows of a labels file and its meta sidecar; a ValueError naming the file where either is
    missing, or a row's drafters are not the sidecar's."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"labels={str(path)!r} does not exist; run router/collect.py first")
    sidecar = meta_path(path)
    if not sidecar.is_file():
        raise ValueError(f"labels={str(path)!r} has no {sidecar.name} next to it; run router/collect.py again")
    try:
        meta = json.loads(sidecar.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"labels sidecar {str(sidecar)!r} is not JSON: {error}") from None
    rows = list(json_objects(path, "labels="))
    for i, row in enumerate(rows):
        for key in LABEL_KEYS:
            if list(row.get(key, {})) != meta["drafters"]:
                raise ValueError(
                    f"labels={str(path)!r} row {i}: {key} names {list(row.get(key, {}))}, meta names {meta['drafters']}"
                )
    return rows, meta
