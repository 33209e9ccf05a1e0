"""Feature-conditioned drafters (EAGLE, Li et al. 2024): draft from the target's own hidden states.

At position t the drafter fuses the target's post-norm last state f_t (the pre-norm stream has
outlier dimensions ~8,000, on which regression fails) with the embedding of x_{t+1}, runs a few
decoder layers and predicts f_{t+1}, which the target's frozen head scores; steps 2..gamma feed the
prediction back. `feature_layers` = (l_1, ..., -1) adds normed inner states (zeros when fed back).
Layout `eagle` is EAGLE-1's as vLLM runs it (no first input norm, no final norm: `bypass`);
`specdecode` runs the body as it is. On disk: the body's HF folder plus `feature_fc.safetensors`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from transformers import PreTrainedModel

from specdecode.models.compat import CACHE_KWARG
from specdecode.models.config import LAST_FEATURE, check_feature_layers, check_layout
from specdecode.models.draft_vocab import DraftVocabHead
from specdecode.models.folders import read_safetensors

FC_FILE = "feature_fc.safetensors"
CONFIG_KEY = "feature_drafter"


def target_features(
    target: PreTrainedModel, hidden_states: Sequence[torch.Tensor], layers: Sequence[int]
) -> torch.Tensor:
    """What a drafter reading `layers` takes from one target forward's `output_hidden_states`:
    `[..., n·H]`, inner layers through the target's final norm. Layers with no trailing -1 are an
    EAGLE-3 drafter's: their raw states, then a zero slot `[..., H]` for its fed-back state (filled
    with the last state where the layers end with L, its training cache's `teacher_layers`).
    """
    if tuple(layers) == LAST_FEATURE:
        return hidden_states[-1]
    if layers[-1] != -1:
        states = [hidden_states[i] for i in layers]
        if layers[-1] != len(hidden_states) - 1:
            states.append(torch.zeros_like(hidden_states[-1]))
        return torch.cat(states, dim=-1)
    norm = target.get_decoder().norm
    parts = [hidden_states[-1] if i == -1 else norm(hidden_states[i]) for i in layers]
    return torch.cat(parts, dim=-1)


def feed_back(predicted: torch.Tensor, width: int) -> torch.Tensor:
    """A predicted last feature `[..., H]` as a drafter input of `width` = n·H: zeros in the inner
    layers' slots (no copy where n = 1)."""
    if predicted.shape[-1] == width:
        return predicted
    return F.pad(predicted, (width - predicted.shape[-1], 0))


class FeatureDrafter(nn.Module):
    """EAGLE-style drafter: `fc([emb(x_{t+1}); f_t])` → decoder layers → norm → ĝ_{t+1} → head.
    `body` is a causal LM with the target's hidden size and vocabulary, `fc` `[H, (1 + n)H]`."""

    def __init__(
        self,
        body: PreTrainedModel,
        fc: nn.Linear,
        feature_layers: Sequence[int] = LAST_FEATURE,
        layout: str = "specdecode",
    ) -> None:
        super().__init__()
        check_layout(layout)
        hidden = body.config.get_text_config().hidden_size
        self.feature_layers = check_feature_layers(feature_layers)
        expected = (hidden, (1 + len(self.feature_layers)) * hidden)
        if tuple(fc.weight.shape) != expected:
            raise ValueError(
                f"fusion layer has shape {tuple(fc.weight.shape)}, expected {expected} "
                f"for feature_layers={list(self.feature_layers)}"
            )
        self.body = body
        self.fc = fc
        self.layout = layout
        if layout == "eagle":
            decoder = body.get_decoder()
            bypass(decoder.layers[0].input_layernorm)
            bypass(decoder.norm)
        setattr(
            body.config, CONFIG_KEY, {"fusion": "concat_linear", "layers": list(self.feature_layers), "layout": layout}
        )

    # The decode loop, validation and training read these like a plain HF model's.
    @property
    def config(self) -> Any:
        return self.body.config

    @property
    def generation_config(self) -> Any:
        return self.body.generation_config

    @property
    def device(self) -> torch.device:
        return self.body.device

    @property
    def dtype(self) -> torch.dtype:
        return self.body.dtype

    def get_input_embeddings(self) -> nn.Embedding:
        return cast(nn.Embedding, self.body.get_input_embeddings())

    def get_output_embeddings(self) -> nn.Linear | DraftVocabHead:
        return cast("nn.Linear | DraftVocabHead", self.body.get_output_embeddings())

    @property
    def feature_width(self) -> int:
        """n·H: the width of the features it reads (`target_features`)."""
        return self.fc.weight.shape[1] - self.body.config.get_text_config().hidden_size

    def timed_module(self) -> nn.Module:
        """What the CPU kernel choice times for it as a causal LM (`models.kernel_choice`): its body."""
        return self.body

    def input_features(self, cached: torch.Tensor) -> torch.Tensor:
        """The features it reads `[..., n·H]` from a training cache's: the same."""
        return cached

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[..., H]` outputs → `[..., K]` logits over its K draft ids (K = V with a full head)."""
        head = self.get_output_embeddings()
        return head.draft_logits(hidden) if isinstance(head, DraftVocabHead) else head(hidden)

    def fuse(self, features: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """`[B, T, n·H]` features f_t and `[B, T]` tokens x_{t+1} → `[B, T, H]` decoder inputs."""
        embeddings = self.get_input_embeddings()(next_ids)
        return self.fc(torch.cat([embeddings, features.to(embeddings.dtype)], dim=-1))

    def forward(
        self,
        features: torch.Tensor,
        next_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
    ) -> torch.Tensor:
        """Predicted next features `[B, T, H]` (the LM head's input) from `[B, T, n·H]` `features`;
        `attention_mask` is a `[B, T]` padding mask or a prepared additive `[B, 1, T, S]` one."""
        return self.body.get_decoder()(
            inputs_embeds=self.fuse(features, next_ids),
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=past_key_values is not None,
            **{CACHE_KWARG: past_key_values},
        ).last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[..., H]` predicted features → `[..., V]` logits through the (frozen) LM head."""
        return self.get_output_embeddings()(hidden)

    def save_pretrained(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        """A plain HF folder for `body` plus the fusion layer (see the module docstring)."""
        self.body.save_pretrained(path, **kwargs)
        save_file({"weight": self.fc.weight.detach().contiguous().cpu()}, str(Path(path) / FC_FILE))


def bypass(norm: nn.Module) -> None:
    """Make `norm` pass its input through (a forward hook) and freeze it; its weight stays in the state dict."""
    norm.requires_grad_(False)
    norm.register_forward_hook(lambda module, args, output: args[0])


def check_fits_target(drafter: FeatureDrafter, target: PreTrainedModel, name: str = "the feature drafter") -> None:
    """The target's width and layers must be the ones `drafter` was built for (else it fails
    mid-draft); a ValueError names the drafter, its features and the target's sizes."""
    text = target.config.get_text_config()
    hidden, num_layers = text.hidden_size, text.num_hidden_layers
    layers = list(drafter.feature_layers)
    if layers[-1] != -1:  # an EAGLE-3 drafter's raw states, and its fed-back slot in the place of -1
        layers.append(-1)
    if drafter.feature_width != len(layers) * hidden or drafter.config.get_text_config().hidden_size != hidden:
        raise ValueError(
            f"{name} reads target states {layers} of width {drafter.feature_width // len(layers)}, but the target's "
            f"hidden size is {hidden}: it was built for another target (train one from this target)"
        )
    check_feature_layers(layers, num_layers, f"{name}: its feature_layers (the target has {num_layers} layers)")


def derive_feature_drafter(
    target: PreTrainedModel,
    num_layers: int = 1,
    *,
    draft_vocab: Any = None,
    corpus: Any = None,
    init_from_layer: int | None = None,
    feature_layers: Sequence[int] = LAST_FEATURE,
    layout: str = "eagle",
    seed: int = 0,
) -> FeatureDrafter:
    """An untrained feature drafter: `derive_drafter(target, num_layers, ...)` as its body, its
    layers at random from `seed` (as EAGLE) or copies of the target's layers ending at
    `init_from_layer` (which trained to lower held-out acceptance); the fusion starts as the sum of
    the embedding and the last feature. A ValueError names a bad argument.
    """
    from specdecode.models.drafters import derive_drafter

    layers = target.get_decoder().layers
    feature_layers = check_feature_layers(feature_layers, len(layers), "drafter.feature_layers")
    check_layout(layout)
    if init_from_layer is not None:  # checked before the body (and its vocabulary) is built
        last = init_from_layer % len(layers) if -len(layers) <= init_from_layer < len(layers) else None
        if last is None or last + 1 < num_layers:
            raise ValueError(
                f"init_from_layer={init_from_layer} must pick one of the target's {len(layers)} layers "
                f"with at least num_layers={num_layers} layers up to it, or None (random)"
            )
    body = derive_drafter(target, num_layers, draft_vocab=draft_vocab, corpus=corpus)
    if init_from_layer is None:
        init_at_random(
            body.get_decoder().layers, getattr(body.config.get_text_config(), "initializer_range", 0.02), seed
        )
    else:
        assert last is not None  # checked with init_from_layer above
        for i, layer in enumerate(body.get_decoder().layers):
            layer.load_state_dict(layers[last + 1 - num_layers + i].state_dict())
            if layout == "eagle":
                # Without the final norm the head would read a raw residual stream, from which
                # training did not recover: the residual branches start at zero instead.
                with torch.no_grad():
                    layer.self_attn.o_proj.weight.zero_()
                    layer.mlp.down_proj.weight.zero_()
    hidden = body.config.get_text_config().hidden_size
    eye, inner = torch.eye(hidden), torch.zeros(hidden, (len(feature_layers) - 1) * hidden)
    fc = fusion_layer(torch.cat([eye, inner, eye], dim=1), target)
    return FeatureDrafter(body, fc, feature_layers, layout).eval()


def init_at_random(layers: Iterable[nn.Module], std: float, seed: int) -> None:
    """Re-initialise `layers` as transformers does a new model (matrices N(0, std), norms 1, biases
    0), drawn on the CPU from `seed`: the same weights on every device and process."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in layers:
            for name, param in layer.named_parameters():
                if param.dim() >= 2:
                    param.copy_(torch.randn(param.shape, generator=generator) * std)
                elif name.endswith("bias"):
                    param.zero_()
                else:  # a norm's scale
                    param.fill_(1.0)


def fusion_layer(weight: torch.Tensor, model: PreTrainedModel) -> nn.Linear:
    """A bias-free linear layer holding `weight` `[out, in]`, on `model`'s device in its dtype."""
    fc = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=model.device, dtype=model.dtype)
    fc.load_state_dict({"weight": weight})
    return fc


def saved_settings(settings: dict[str, Any], folder: str | os.PathLike[str]) -> tuple[list[int], str]:
    """The feature layers and layout a feature drafter folder's `config.feature_drafter` records."""
    missing = sorted({"layers", "layout"} - set(settings))
    if missing:
        raise ValueError(
            f"feature drafter {str(folder)!r}: config.{CONFIG_KEY} lacks {missing} (another version wrote it)"
        )
    return list(settings["layers"]), str(settings["layout"])


def wrap_if_feature_drafter(model: PreTrainedModel, folder: str | os.PathLike[str]) -> PreTrainedModel | FeatureDrafter:
    """`model` loaded from `folder`, as a `FeatureDrafter` if its config says it is one.

    Raises FileNotFoundError: no `feature_fc.safetensors`; ValueError: naming it, damaged or not fitting.
    """
    settings = getattr(model.config, CONFIG_KEY, None)
    if settings is None:
        return model
    path = Path(folder) / FC_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{str(folder)!r} is a feature drafter (config.{CONFIG_KEY}) but has no {FC_FILE}")
    tensors = read_safetensors(path)
    if "weight" not in tensors or tensors["weight"].dim() != 2:
        raise ValueError(f"{str(path)!r} holds no 2-D 'weight' tensor (it holds {sorted(tensors)}): not a fusion layer")
    fc = fusion_layer(tensors["weight"], model)
    layers, layout = saved_settings(settings, folder)
    try:
        return FeatureDrafter(model, fc, layers, layout).eval()
    except ValueError as error:
        raise ValueError(f"feature drafter {str(folder)!r}: {error}") from None
