"""Feature-conditioned (EAGLE-style) drafters: exactness in the shared loop, decode-time drafts equal
to the unrolled training forward, save/load, and bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from specdecode import speculative_generate
from specdecode.decoding.drafting import FeatureDrafting
from specdecode.models.feature_drafter import FeatureDrafter, derive_feature_drafter, feed_back, target_features
from specdecode.training.feature_training import unrolled_features
from tests.models_for_tests import tiny_llama

V = 64


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(3, seed=0)


def random_feature_drafter(target: torch.nn.Module, seed: int = 1, std: float = 0.4, **kwargs) -> FeatureDrafter:
    """A feature drafter whose fusion is random (N(0, std²)), so its drafts are neither always right
    nor trivial."""
    torch.manual_seed(seed)
    drafter = derive_feature_drafter(target, 1, **kwargs)
    with torch.no_grad():
        drafter.fc.weight.normal_(0, std)
    return drafter


def end_to_end_mask(length: int, steps: int, padding: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask `[B, 1, kT, kT]` for training k drafting steps at once (EAGLE-3's
    training-time test), the k passes laid end to end.

    Pass j (1-based) at position s stands for the j-th drafting step made at s. Decoding, that
    query sees the cache of true-feature entries up to s - j + 1 and the entries that steps 2..j
    wrote at s - j + 2 .. s; so pass-1 keys at positions <= s - j + 1 and the pass-i key at
    s - j + i (2 <= i <= j). Pass 1 is ordinary causal attention. `padding` `[B, T]` (1 = token)
    hides padded keys.
    """
    device = padding.device
    s = torch.arange(length, device=device)
    blocks = []
    for j in range(1, steps + 1):
        row = []
        for i in range(1, steps + 1):
            if i == 1:
                visible = s.view(1, -1) <= (s - j + 1).view(-1, 1)
            elif i <= j:
                visible = s.view(1, -1) == (s - j + i).view(-1, 1)
            else:
                visible = torch.zeros(length, length, dtype=torch.bool, device=device)
            row.append(visible)
        blocks.append(torch.cat(row, dim=1))
    visible = torch.cat(blocks, dim=0).unsqueeze(0) & padding.bool().repeat(1, steps).unsqueeze(1)
    # Queries with nothing visible (the first j - 1 positions of pass j, never scored) see
    # themselves, so softmax stays finite.
    visible = visible | torch.eye(steps * length, dtype=torch.bool, device=device).unsqueeze(0)
    mask = torch.zeros(visible.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min).unsqueeze(1)


def passes_end_to_end(
    drafter: nn.Module, features: torch.Tensor, next_ids: torch.Tensor, padding: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """The reference `unrolled_features` is checked against (what training ran before the windows):
    every pass at every position, the passes laid end to end under `end_to_end_mask`, each call
    recomputing the passes before it."""
    batch, length, _ = features.shape
    positions = torch.arange(length, device=features.device).expand(batch, -1)
    hidden = drafter(features, next_ids, attention_mask=padding, position_ids=positions)
    outputs = [hidden]
    fed_features, fed_ids = [features], [next_ids]
    for j in range(2, steps + 1):
        # Position t of pass j reads the previous pass's prediction made at t - 1 (shifted right);
        # position 0 has none and is never scored, so it reads its true feature.
        previous = torch.cat([features[:, :1], feed_back(outputs[-1][:, :-1], features.shape[-1])], dim=1)
        fed_features.append(previous)
        fed_ids.append(next_ids)
        mask = end_to_end_mask(length, j, padding, hidden.dtype)
        hidden = drafter(
            torch.cat(fed_features, 1), torch.cat(fed_ids, 1), attention_mask=mask, position_ids=positions.repeat(1, j)
        )
        outputs.append(hidden[:, -length:])
    return outputs


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt], device=model.device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


MULTI = (1, 2, -1)  # the tiny target's states after layers 1 and 2, and its last


@pytest.mark.parametrize("gamma, layers", [(1, (-1,)), (3, (-1,)), (5, (-1,)), (3, MULTI)])
def test_greedy_matches_transformers_greedy(target, ragged_prompts, gamma, layers) -> None:
    drafter = random_feature_drafter(target, feature_layers=layers)
    expected = [hf_greedy(target, p, 24) for p in ragged_prompts]
    batched = speculative_generate(target, drafter, ragged_prompts, gamma=gamma, max_new_tokens=24, eos_token_ids=[])
    single = speculative_generate(
        target, drafter, ragged_prompts[3:4], gamma=gamma, max_new_tokens=24, eos_token_ids=[]
    )
    assert batched.sequences == expected
    assert single.sequences == expected[3:4]
    assert batched.stats.drafted > 0


def test_truncated_vocabulary_feature_drafter_is_exact(target, ragged_prompts) -> None:
    drafter = random_feature_drafter(target, draft_vocab=list(range(0, V, 2)))
    result = speculative_generate(target, drafter, ragged_prompts, gamma=3, max_new_tokens=16, eos_token_ids=[])
    assert result.sequences == [hf_greedy(target, p, 16) for p in ragged_prompts]


@pytest.mark.parametrize("layers, draft_vocab", [((-1,), None), (MULTI, None), ((-1,), list(range(0, V, 3)))])
def test_decode_time_drafts_equal_the_unrolled_training_forward(
    target, ragged_prompts, monkeypatch, layers, draft_vocab
) -> None:
    """What the cached, ragged decode loop feeds the drafter must be what training unrolls: each
    step's q equals a from-scratch forward of `unrolled_features` over committed tokens + drafts,
    with the target's features recomputed over the whole sequence. Fails if a window, a feature
    offset, a cache trim, the training mask, (multi-layer) the fed-back slot or (truncated head)
    the q computed over the draft ids and spread to the vocabulary is off."""
    gamma = 3
    drafter = random_feature_drafter(target, seed=2, feature_layers=layers, draft_vocab=draft_vocab)
    records = []
    original = FeatureDrafting.propose

    def recording(self, tokens, lengths, max_length, gamma_, params, generator):
        draft, q = original(self, tokens, lengths, max_length, gamma_, params, generator)
        records.append((tokens.clone(), lengths.clone(), draft.clone(), q.clone()))
        return draft, q

    monkeypatch.setattr(FeatureDrafting, "propose", recording)
    speculative_generate(
        target,
        drafter,
        ragged_prompts,
        gamma=gamma,
        max_new_tokens=12,
        temperature=1.0,
        eos_token_ids=[],
        seed=0,
        prompt_lookup=None,
    )
    assert len(records) >= 3
    checked = 0
    with torch.no_grad():
        for tokens, lengths, draft, q in records[:4]:
            for row in range(tokens.shape[0]):
                length = int(lengths[row])
                sequence = torch.cat([tokens[row, :length], draft[row, : gamma - 1]]).unsqueeze(0)
                features = target_features(target, target(sequence, output_hidden_states=True).hidden_states, layers)
                passes = unrolled_features(
                    drafter, features[:, :-1], sequence[:, 1:], torch.ones_like(sequence[:, 1:]), gamma
                )
                for j in range(gamma):  # draft j + 1 is made at position length - 2 + j by pass j + 1
                    expected = drafter.logits(passes[j][0, length - 2 + j]).softmax(-1)
                    # fp32 noise: this random, unnormalised drafter reaches logits of ~1,000 (hidden
                    # states of ~1,500) at some steps, where another summation order moves a
                    # probability by up to ~1e-3 on some CPUs; an off window, offset or trim moves
                    # q by far more (each such mutation fails every case)
                    torch.testing.assert_close(q[row, j], expected, atol=3e-3, rtol=1e-3)
                    checked += 1
    assert checked >= 3 * gamma


MULTI_TEST = (1, -1)


@pytest.mark.parametrize("steps, layers", [(2, (-1,)), (3, (-1,)), (4, MULTI_TEST)])
def test_windowed_unrolled_passes_equal_every_position_where_needed(target, steps, layers) -> None:
    """Passes 2..steps run only on a window around the needed positions (`needed=`): there, outputs
    and gradients must be those of every pass at every position. Rows: a right-padded one, needed
    positions scattered with gaps, one near the start (the window clamps at 0), one needing
    nothing, one needing the last position (the window shifts left), a left-padded one. Fails if the window misses
    the steps - 2 positions before a row's first needed one, a pass-i key is misplaced in the
    mask, padding is visible, or the fed-back feature is read at the wrong offset."""
    # float64 and a tame fusion (random_feature_drafter's, scaled by 0.1: at full scale 3 unrolled
    # passes amplify rounding ~1e8-fold), so the two agree to ~1e-14 and a real difference stands out
    drafter = random_feature_drafter(target, seed=6, feature_layers=layers).double().train()
    with torch.no_grad():
        drafter.fc.weight.mul_(0.1)
    generator = torch.Generator().manual_seed(7)
    batch, length = 6, 14
    ids = torch.randint(0, V, (batch, length), generator=generator)
    features = torch.randn(batch, length, drafter.feature_width, generator=generator, dtype=torch.float64)
    padding = torch.ones(batch, length, dtype=torch.long)
    padding[1, 10:] = 0
    padding[5, :3] = 0  # left-padded
    needed = torch.zeros(batch, length, dtype=torch.bool)
    needed[0, 8:] = True
    needed[1, [4, 6, 9]] = True
    needed[2, 1:4] = True
    needed[4, 12:] = True
    needed[5, 4:9] = True
    everywhere = passes_end_to_end(drafter, features, ids, padding, steps)
    windowed = unrolled_features(drafter, features, ids, padding, steps, needed=needed)
    assert len(windowed) == steps and all(w.shape == e.shape for w, e in zip(windowed, everywhere))
    # pass j + 1 is made from position j on (`pass_positions`)
    scored = [needed & (torch.arange(length) >= j) for j in range(steps)]
    for j in range(steps):
        torch.testing.assert_close(windowed[j][scored[j]], everywhere[j][scored[j]], atol=1e-12, rtol=1e-10)

    weights = torch.randn(steps, batch, length, everywhere[0].shape[-1], generator=generator, dtype=torch.float64)

    def grads(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        drafter.zero_grad()
        sum((o * w)[m].sum() for o, w, m in zip(outputs, weights, scored)).backward()
        return [p.grad.clone() for p in drafter.parameters() if p.grad is not None]

    for got, want in zip(
        grads(unrolled_features(drafter, features, ids, padding, steps, needed=needed)),
        grads(passes_end_to_end(drafter, features, ids, padding, steps)),
    ):
        assert torch.isfinite(want).all() and (got - want).abs().max() <= 1e-12 * want.abs().max()


def test_end_to_end_mask_pattern() -> None:
    mask = end_to_end_mask(4, 2, torch.ones(1, 4), torch.float32)[0, 0] == 0
    # pass 2 at position 2: pass-1 keys 0..1 and its own pass-2 key at 2
    assert mask[4 + 2].tolist() == [True, True, False, False, False, False, True, False]
    # pass 1 is causal
    assert mask[1].tolist() == [True, True, False, False, False, False, False, False]


def test_save_and_load_round_trip(target, tmp_path) -> None:
    from specdecode.models import load_model

    drafter = random_feature_drafter(target, draft_vocab=list(range(0, V, 2)))
    drafter.save_pretrained(tmp_path)
    restored = load_model(tmp_path)[0] if (tmp_path / "tokenizer.json").exists() else None
    if restored is None:  # no tokenizer in this folder: restore the model part directly
        from specdecode.models.draft_vocab import apply_draft_vocab_from_config
        from specdecode.models.feature_drafter import wrap_if_feature_drafter

        restored = wrap_if_feature_drafter(
            apply_draft_vocab_from_config(AutoModelForCausalLM.from_pretrained(tmp_path)), tmp_path
        )
    assert isinstance(restored, FeatureDrafter)
    features, ids = torch.randn(2, 5, 32), torch.randint(0, V, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(restored.logits(restored(features, ids)), drafter.logits(drafter(features, ids)))
    # transformers reads the folder as an ordinary 1-layer causal LM
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.num_hidden_layers == 1


def test_multi_layer_drafter_reads_normed_inner_states_and_round_trips(target, tmp_path) -> None:
    """feature_layers=(1, 2, -1): the features are [norm(h_1); norm(h_2); h_last] (`[.., 3H]`); the
    untrained fusion ignores the inner slots (it is the one-layer drafter); saved and loaded, the
    layers and the fusion come back."""
    from specdecode.models.draft_vocab import apply_draft_vocab_from_config
    from specdecode.models.feature_drafter import wrap_if_feature_drafter

    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
        features = target_features(target, states, MULTI)
        norm = target.get_decoder().norm
        torch.testing.assert_close(features, torch.cat([norm(states[1]), norm(states[2]), states[-1]], -1))
        torch.manual_seed(0)
        one = derive_feature_drafter(target, 1)
        torch.manual_seed(0)
        multi = derive_feature_drafter(target, 1, feature_layers=MULTI)
        torch.testing.assert_close(multi(features, ids), one(states[-1], ids))
    drafter = random_feature_drafter(target, feature_layers=MULTI)
    drafter.save_pretrained(tmp_path)
    restored = wrap_if_feature_drafter(
        apply_draft_vocab_from_config(AutoModelForCausalLM.from_pretrained(tmp_path)), tmp_path
    )
    assert restored.feature_layers == MULTI and restored.feature_width == 3 * 32
    with torch.no_grad():
        torch.testing.assert_close(restored(features, ids), drafter(features, ids))


@pytest.mark.parametrize("layers", [[1, 2], [3, -1], [0, -1], [2, 2, -1], [], "-1"])
def test_bad_feature_layers_are_named(target, layers) -> None:
    with pytest.raises(ValueError, match=r"drafter.feature_layers=.*followed by -1"):
        derive_feature_drafter(target, 1, feature_layers=layers)


def test_missing_fusion_file_is_named(target, tmp_path) -> None:
    from specdecode.models.feature_drafter import FC_FILE, wrap_if_feature_drafter

    drafter = random_feature_drafter(target)
    drafter.save_pretrained(tmp_path)
    (tmp_path / FC_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=FC_FILE):
        wrap_if_feature_drafter(AutoModelForCausalLM.from_pretrained(tmp_path), tmp_path)


def test_bad_init_layer_is_named(target) -> None:
    with pytest.raises(ValueError, match=r"init_from_layer=7 .* or None \(random\)"):
        derive_feature_drafter(target, 1, init_from_layer=7)


@pytest.mark.parametrize("layout", ["specdecode", "eagle"])
def test_random_init_draws_fresh_layers_from_the_seed_and_stays_exact(ragged_prompts, layout) -> None:
    """`init_from_layer=None`: the layers are transformers-style fresh weights (matrices with std
    initializer_range, unit norms), not the target's, the same for the same seed and different for
    another; the fusion still starts as embedding + feature, and decoding stays exact."""
    target = tiny_llama(3, seed=0)
    with torch.no_grad():  # norms that are not 1, so that a copied norm shows
        for name, param in target.named_parameters():
            if "norm" in name:
                param.fill_(1.5)
    drafter = derive_feature_drafter(target, 2, init_from_layer=None, layout=layout, seed=5)
    again = derive_feature_drafter(target, 2, init_from_layer=None, layout=layout, seed=5)
    other = derive_feature_drafter(target, 2, init_from_layer=None, layout=layout, seed=6)
    copied = derive_feature_drafter(target, 2, init_from_layer=-1, layout=layout)
    std = target.config.initializer_range
    layer = drafter.body.get_decoder().layers[1]
    for name, param in layer.named_parameters():
        if param.dim() == 2:
            assert abs(param.std().item() - std) < 0.2 * std, name
            assert not torch.equal(param, copied.body.get_decoder().layers[1].get_parameter(name)), name
        else:
            assert torch.equal(param, torch.ones_like(param)), name
    assert all(torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), again.state_dict().values()))
    assert not all(torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), other.state_dict().values()))
    assert torch.equal(drafter.fc.weight, copied.fc.weight)
    out = speculative_generate(target, drafter, ragged_prompts[:3], gamma=3, max_new_tokens=12, eos_token_ids=[])
    for prompt, tokens in zip(ragged_prompts[:3], out.sequences):
        assert tokens == hf_greedy(target, prompt, 12)


@pytest.mark.parametrize("layers", [(-1,), MULTI])
def test_step_costs_time_a_feature_drafter_step(target, layers) -> None:
    from specdecode.decoding.timing import measure_step_costs

    costs = measure_step_costs(
        target, random_feature_drafter(target, feature_layers=layers), list(range(10)), gamma=3, repeats=2
    )
    assert costs.drafter_step_s > 0 and costs.cost_ratio > 0


def test_training_logits_at_loss_positions_are_the_unrolled_passes_there(target) -> None:
    """`FeatureDrafterLogits` runs the head only at the loss positions; what it returns there must
    be the unrolled passes' head outputs, shifted onto standard positions (pass output t - 1 at t),
    in row-major order. Fails if the shift, the order or the pass stacking is off."""
    from specdecode.training.feature_training import FeatureDrafterLogits, pass_positions

    drafter = random_feature_drafter(target, seed=3)
    generator = torch.Generator().manual_seed(4)
    input_ids = torch.randint(0, V, (3, 9), generator=generator)
    padding = torch.ones(3, 9, dtype=torch.long)
    padding[1, 6:] = 0  # a right-padded row
    features = torch.randn(3, 9, 32, generator=generator)
    positions = torch.zeros(3, 9, dtype=torch.bool)
    positions[0, 4:] = True
    positions[1, 1:6] = True
    positions[2, [2, 7]] = True
    with torch.no_grad():
        logits, predicted = FeatureDrafterLogits(drafter, 3)(input_ids, padding, features, positions)
        passes = unrolled_features(drafter, features[:, :-1], input_ids[:, 1:], padding[:, 1:], 3)
    count = int(positions.sum())
    assert logits.shape == (3, count, V) and predicted.shape == (3, count, 32)
    rows, cols = positions.nonzero(as_tuple=True)
    for j, hidden in enumerate(passes):
        expected = hidden[rows, cols - 1]
        torch.testing.assert_close(predicted[j], expected)
        torch.testing.assert_close(logits[j], drafter.logits(expected))
    # pass 3 cannot score position 1 or 2 (it needs two drafted steps before it)
    assert pass_positions(positions, 3)[:, positions][2].tolist() == (cols >= 3).tolist()


def training_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`FeatureDrafterLogits` inputs: 2 unpadded rows of 8 tokens, random features, loss from position 3."""
    generator = torch.Generator().manual_seed(4)
    positions = torch.zeros(2, 8, dtype=torch.bool)
    positions[:, 3:] = True
    return (
        torch.randint(0, V, (2, 8), generator=generator),
        torch.ones(2, 8, dtype=torch.long),
        torch.randn(2, 8, 32, generator=generator),
        positions,
    )


@pytest.mark.parametrize("steps", [1, 3])
def test_training_never_reads_a_sequences_last_feature(target, steps) -> None:
    """Target continuations come with the features of the tokens the target read, and the last
    token is never read (`autoregressive_generate`): its row is stored as zero. That is only sound
    if training's outputs and regression targets at the loss positions do not depend on that row;
    a right-padded batch of `pad_batch` sequences, with it random or zero, must train alike."""
    from specdecode.training.feature_training import FeatureDrafterLogits
    from specdecode.training.sequences import TrainSequence
    from specdecode.training.teacher import pad_batch

    drafter = random_feature_drafter(target, seed=3)
    generator = torch.Generator().manual_seed(8)
    sequences = [
        TrainSequence(torch.randint(0, V, (n,), generator=generator).tolist(), start)
        for n, start in ((11, 4), (7, 3), (9, 8))
    ]
    input_ids, padding, positions = pad_batch(sequences, 0)
    features = torch.randn(3, 11, 32, generator=generator)
    last = torch.tensor([len(s.tokens) - 1 for s in sequences])
    zeroed, noisy = features.clone(), features.clone()
    zeroed[torch.arange(3), last] = 0
    noisy[torch.arange(3), last] = 100 * torch.randn(3, 32, generator=generator)
    assert not positions[torch.arange(3), last].any()  # no regression target or teacher there
    with torch.no_grad():
        a = FeatureDrafterLogits(drafter, steps)(input_ids, padding, zeroed, positions)
        b = FeatureDrafterLogits(drafter, steps)(input_ids, padding, noisy, positions)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_training_logits_under_bf16_autocast_are_fp32_and_close_to_the_fp32_ones(target) -> None:
    """Mixed precision (`train.mixed_precision=bf16`): the passes run in bf16 autocast (so they
    differ from fp32 by bf16 roundings, ~6% in norm on this random drafter, not more) and come
    back in fp32 for the losses."""
    from specdecode.training.feature_training import FeatureDrafterLogits

    drafter = random_feature_drafter(target, seed=3)
    input_ids, padding, features, positions = training_batch()
    with torch.no_grad():
        full = FeatureDrafterLogits(drafter, 2)(input_ids, padding, features, positions)
        mixed = FeatureDrafterLogits(drafter, 2, torch.bfloat16)(input_ids, padding, features, positions)
    for a, b in zip(full, mixed):
        assert b.dtype == torch.float32 and not torch.equal(a, b)
        assert float((b - a).norm() / a.norm()) < 0.1


def test_feature_noise_perturbs_the_read_features_in_training_only(target) -> None:
    """`train.feature_noise` (EAGLE's): in training mode the drafter reads the target features plus
    U(-a, a) noise, so the outputs move (by at most what a one-layer drafter's Lipschitz bound
    allows, here checked loosely); in eval mode (held-out selection) they are the noise-free ones.
    Fails if the noise is skipped, leaks into evaluation, or is added at the wrong scale."""
    from specdecode.training.feature_training import FeatureDrafterLogits

    drafter = random_feature_drafter(target, seed=3)
    input_ids, padding, features, positions = training_batch()
    clean, noisy = FeatureDrafterLogits(drafter, 2), FeatureDrafterLogits(drafter, 2, noise=0.5)
    with torch.no_grad():
        reference = clean(input_ids, padding, features, positions)
        noisy.eval()
        for a, b in zip(reference, noisy(input_ids, padding, features, positions)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        noisy.train()
        torch.manual_seed(0)
        perturbed = noisy(input_ids, padding, features, positions)
        torch.manual_seed(0)
        again = noisy(input_ids, padding, features, positions)
    for a, b, c in zip(reference, perturbed, again):
        torch.testing.assert_close(b, c, rtol=0, atol=0)  # the noise comes from the seeded global RNG (resumable)
        change = float((b - a).norm() / a.norm())
        assert 1e-3 < change < 1.0
    # a tiny noise moves the outputs only a little: the scale is `noise`, not a unit one
    tiny = FeatureDrafterLogits(drafter, 2, noise=1e-4).train()
    with torch.no_grad():
        small = tiny(input_ids, padding, features, positions)
    assert float((small[1] - reference[1]).norm() / reference[1].norm()) < 1e-3
