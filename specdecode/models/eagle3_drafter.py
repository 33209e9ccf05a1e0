"""EAGLE-3 drafters (Li et al. 2025), built as vLLM's and SGLang's EAGLE-3 loaders run them.

`fc` fuses three raw target states (inputs to layers l_1..l_3; by default 2, L//2, L-3) 3H → H into
g_t; one decoder layer attends over `[norm(embedding(x_{t+1})); norm(g_t)]` (2H wide) with its
residual stream starting from g_t; its own norm and draft-vocabulary head score x_{t+2}. As a
`FeatureDrafter` its features are 4H wide: `[s_1; s_2; s_3; 0]` from the target, `[0; 0; 0; g]` fed
back. On disk: a Llama folder with no decoder layers plus `eagle3.safetensors`.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

from specdecode.models.config import check_eagle3_layers, default_feature_layers
from specdecode.models.draft_vocab import DraftVocabHead
from specdecode.models.drafters import resolve_draft_vocab
from specdecode.models.feature_drafter import (
    CONFIG_KEY,
    FeatureDrafter,
    bypass,
    fusion_layer,
    init_at_random,
    wrap_if_feature_drafter,
)
from specdecode.models.folders import read_safetensors

EAGLE3_FILE = "eagle3.safetensors"
FUSION = "eagle3"


def teacher_layers(layers: Sequence[int], num_target_layers: int) -> tuple[int, ...]:
    """The target layers an EAGLE-3 drafter's training cache keeps: its three, then L, whose state
    fills the fed-back slot for the distillation teacher (never the drafter: `input_features`)."""
    return (*layers, num_target_layers)


def llama_config_like(text: Any, **overrides: Any) -> LlamaConfig:
    """A Llama config with the shape, norm and rotary settings of `text` (a Llama-like text config)."""
    return LlamaConfig(
        **{
            "vocab_size": text.vocab_size,
            "hidden_size": text.hidden_size,
            "intermediate_size": text.intermediate_size,
            "num_hidden_layers": text.num_hidden_layers,
            "num_attention_heads": text.num_attention_heads,
            "num_key_value_heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
            "head_dim": getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
            "hidden_act": text.hidden_act,
            "max_position_embeddings": text.max_position_embeddings,
            "rms_norm_eps": text.rms_norm_eps,
            "rope_parameters": dict(text.rope_parameters),
            "bos_token_id": text.bos_token_id,
            "eos_token_id": text.eos_token_id,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            **overrides,
        }
    )


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: input `[B, T, 2H]` = `[embedding; g]` → pre-norm output `[B, T, H]`.
    Called by the body's decoder as its one layer (a transformers decoder layer's signature)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        head_dim = config.head_dim or hidden // config.num_attention_heads
        kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.self_attn = LlamaAttention(config, layer_idx=0)
        self.self_attn.q_proj = nn.Linear(2 * hidden, config.num_attention_heads * head_dim, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """`kwargs`: the decoder's, the KV cache among them (by the keyword of this transformers), for the attention."""
        embeds, fused = hidden_states.chunk(2, dim=-1)
        attended, _ = self.self_attn(
            torch.cat([self.input_layernorm(embeds), self.hidden_norm(fused)], dim=-1),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            **kwargs,
        )
        residual = fused + attended
        return residual + self.mlp(self.post_attention_layernorm(residual))


class NormedDraftHead(DraftVocabHead):
    """EAGLE-3's final norm and LM head as one head: the decode loop scores `draft_logits` of the
    drafter's pre-norm output directly, so the norm lives in the head."""

    def __init__(self, full_weight: torch.Tensor, draft_ids: torch.Tensor, eps: float) -> None:
        super().__init__(full_weight, draft_ids)
        self.norm: LlamaRMSNorm = LlamaRMSNorm(full_weight.shape[1], eps=eps).to(full_weight.device, full_weight.dtype)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().draft_logits(self.norm(hidden))


class Eagle3Drafter(FeatureDrafter):
    """A `FeatureDrafter` with EAGLE-3's fusion `fc` `[H, 3H]`, layer and head: `body` is a one-layer
    Llama (an `Eagle3Layer`, its decoder norm bypassed, a `NormedDraftHead`)."""

    def __init__(self, body: PreTrainedModel, fc: nn.Linear, feature_layers: Sequence[int]) -> None:
        nn.Module.__init__(self)  # not FeatureDrafter's checks: those are of EAGLE-1's fusion
        hidden = body.config.hidden_size
        if tuple(fc.weight.shape) != (hidden, 3 * hidden) or not isinstance(
            body.get_output_embeddings(), NormedDraftHead
        ):
            raise ValueError(
                f"an EAGLE-3 drafter needs a [{hidden}, {3 * hidden}] fusion and a NormedDraftHead; "
                f"got {tuple(fc.weight.shape)} and {type(body.get_output_embeddings()).__name__}"
            )
        self.body, self.fc, self.layout = body, fc, FUSION
        self.feature_layers = tuple(feature_layers)
        bypass(body.get_decoder().norm)
        setattr(body.config, CONFIG_KEY, {"fusion": FUSION, "layers": list(self.feature_layers)})

    @property
    def feature_width(self) -> int:
        """4H: the three target states and the fed-back slot."""
        return self.fc.in_features + self.body.config.hidden_size

    def timed_module(self) -> nn.Module:
        """A drafting pass over zero target states (its body cannot run on tokens alone)."""
        return Eagle3Timing(self)

    def input_features(self, cached: torch.Tensor) -> torch.Tensor:
        """`[s_1; s_2; s_3; 0]` from a training cache's `[..., 4H]` `[s_1; s_2; s_3; f]` (`teacher_layers`)."""
        states = cached[..., : self.fc.in_features]
        return torch.cat([states, states.new_zeros(*states.shape[:-1], cached.shape[-1] - states.shape[-1])], dim=-1)

    def fuse(self, features: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """`[B, T, 4H]` features and `[B, T]` tokens → `[B, T, 2H]` `[embedding; g]`."""
        embeddings = self.get_input_embeddings()(next_ids)
        features = features.to(embeddings.dtype)
        fused = self.fc(features[..., : self.fc.in_features]) + features[..., self.fc.in_features :]
        return torch.cat([embeddings, fused], dim=-1)

    @property
    def layer(self) -> Eagle3Layer:
        return self.body.get_decoder().layers[0]

    def save_pretrained(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        """The folder the module docstring describes."""
        config = copy.deepcopy(self.body.config)
        config.num_hidden_layers = 0
        with torch.device("meta"):
            plain = LlamaForCausalLM(cast(LlamaConfig, config))
        head = cast(NormedDraftHead, self.get_output_embeddings())
        plain.load_state_dict(
            {
                "model.embed_tokens.weight": self.get_input_embeddings().weight.detach(),
                "model.norm.weight": self.body.get_decoder().norm.weight.detach(),
                "lm_head.weight": head.full_weight(),
            },
            assign=True,
        )
        plain.generation_config = self.body.generation_config
        plain.save_pretrained(path, **kwargs)
        tensors = {"fc.weight": self.fc.weight, "norm.weight": head.norm.weight}
        tensors |= {f"layer.{name}": value for name, value in self.layer.state_dict().items()}
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(Path(path) / EAGLE3_FILE))


class Eagle3Timing(nn.Module):
    """An EAGLE-3 drafter as the CPU kernel choice times a causal LM: `forward(input_ids)` `[B, T]`
    runs a drafting pass over zero target states through the fusion, the layer and the head."""

    def __init__(self, drafter: Eagle3Drafter) -> None:
        super().__init__()
        self.drafter = drafter
        # read as a causal LM's; made where the drafter is timed, so its placement is final
        self.config, self.device, self.dtype = drafter.config, drafter.device, drafter.dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        features = torch.zeros(*input_ids.shape, self.drafter.feature_width, device=self.device, dtype=self.dtype)
        return self.drafter.logits(self.drafter(features, input_ids))


def derive_eagle3_drafter(
    target: PreTrainedModel,
    *,
    feature_layers: Sequence[int] | None = None,
    draft_vocab: int | Sequence[int] | torch.Tensor | None = None,
    corpus: Iterable[Sequence[int] | torch.Tensor] | None = None,
    seed: int = 0,
) -> Eagle3Drafter:
    """An untrained EAGLE-3 drafter for a Llama- or Qwen2-like `target`: its embeddings and head rows
    (over `draft_vocab`, as `derive_drafter` reads it), a layer at random from `seed`, a fusion
    starting as the high state. A ValueError names bad `feature_layers` or vocabulary."""
    text = target.config.get_text_config()
    layers = check_eagle3_layers(
        feature_layers or default_feature_layers(text.num_hidden_layers), text.num_hidden_layers
    )
    draft_ids = resolve_draft_vocab(target, draft_vocab, corpus)
    config = llama_config_like(text, num_hidden_layers=1)
    if draft_ids is not None:
        config.draft_vocab_ids = draft_ids.tolist()
    body = LlamaForCausalLM(config)
    body.model.layers = nn.ModuleList([Eagle3Layer(config)])
    body.to(device=target.device, dtype=target.dtype)  # type: ignore[call-arg]  # transformers' wrapped `.to` hides its signature
    init_at_random(body.model.layers, getattr(text, "initializer_range", 0.02), seed)
    with torch.no_grad():
        body.model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    full_head = target.get_output_embeddings().weight.detach()
    ids = draft_ids if draft_ids is not None else torch.arange(text.vocab_size, device=full_head.device)
    body.set_output_embeddings(NormedDraftHead(full_head, ids, text.rms_norm_eps))
    hidden = text.hidden_size
    fc = fusion_layer(torch.cat([torch.zeros(hidden, 2 * hidden), torch.eye(hidden)], dim=1), target)
    return Eagle3Drafter(body, fc, layers).eval()


def load_eagle3(model: PreTrainedModel, folder: str | os.PathLike[str]) -> Eagle3Drafter:
    """The EAGLE-3 drafter saved in `folder`, from the plain model `load_model` read there; a
    ValueError names a missing or unfitting `eagle3.safetensors`."""
    path = Path(folder) / EAGLE3_FILE
    if not path.is_file():
        raise ValueError(f"{str(folder)!r} is an EAGLE-3 drafter (config.{CONFIG_KEY}) but has no {EAGLE3_FILE}")
    tensors = read_safetensors(path)
    config = model.config
    config.num_hidden_layers = 1
    layer = Eagle3Layer(cast(LlamaConfig, config)).to(model.device, model.dtype)
    try:
        layer.load_state_dict({k.removeprefix("layer."): v for k, v in tensors.items() if k.startswith("layer.")})
        head = model.get_output_embeddings()
        full = head.full_weight() if isinstance(head, DraftVocabHead) else head.weight.detach()
        ids = head.draft_ids if isinstance(head, DraftVocabHead) else torch.arange(full.shape[0], device=full.device)
        normed = NormedDraftHead(full, ids, config.rms_norm_eps)
        normed.norm.load_state_dict({"weight": tensors["norm.weight"]})
        fc = fusion_layer(tensors["fc.weight"], model)
    except (KeyError, RuntimeError) as error:
        raise ValueError(f"{str(path)!r} does not fit the drafter in {str(folder)!r}: {error}") from None
    model.model.layers = nn.ModuleList([layer])
    model.set_output_embeddings(normed)
    return Eagle3Drafter(model, fc, getattr(config, CONFIG_KEY)["layers"]).eval()


def wrap_drafter(model: PreTrainedModel, folder: str | os.PathLike[str]) -> PreTrainedModel | FeatureDrafter:
    """`model` loaded from `folder` as the drafter its config says: EAGLE-3, another feature drafter, or itself."""
    if (getattr(model.config, CONFIG_KEY, None) or {}).get("fusion") == FUSION:
        return load_eagle3(model, folder)
    return wrap_if_feature_drafter(model, folder)
