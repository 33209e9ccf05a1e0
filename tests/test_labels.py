"""Router labels: teacher-forced acceptance equals a direct per-prompt computation; speedups use c."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from specdecode.core.config import from_dict
from specdecode.data.example import Example
from specdecode.decoding.decode import autoregressive_generate
from specdecode.decoding.speedup import predicted_speedup
from specdecode.models import derive_drafter
from specdecode.models.smoke import smoke_target, smoke_tokenizer
from specdecode.routing.collect import run_collect
from specdecode.routing.config import CollectConfig
from specdecode.routing.labels import collect_labels, label_rows, meta_path, read_labels, teacher_forced_acceptance
from tests.models_for_tests import tiny_llama

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [20], [30, 31, 32, 33], [40, 41]]


@pytest.fixture
def models() -> tuple[LlamaForCausalLM, list[tuple[str, LlamaForCausalLM]]]:
    target = tiny_llama(3, seed=0)
    drafters = [("one", tiny_llama(1, seed=1)), ("two", tiny_llama(2, seed=2)), ("self", target)]
    return target, drafters


def _direct(
    target: LlamaForCausalLM, drafter: LlamaForCausalLM, prompt: list[int], max_new_tokens: int, temperature: float
) -> tuple[float, float, list[int]]:
    """Unpadded, one prompt: the greedy continuation, mean Σ min(p, q) and argmax agreement along it."""
    continuation = autoregressive_generate(target, [prompt], max_new_tokens=max_new_tokens).sequences[0]
    ids = torch.tensor([prompt + continuation])
    scored = slice(len(prompt) - 1, len(prompt) + len(continuation) - 1)
    with torch.no_grad():
        p = target(ids).logits[0, scored] / (temperature or 1.0)
        q = drafter(ids).logits[0, scored] / (temperature or 1.0)
    acceptance = torch.minimum(p.softmax(-1), q.softmax(-1)).sum(-1).mean().item()
    match = (p.argmax(-1) == q.argmax(-1)).float().mean().item()
    return acceptance, match, continuation


@pytest.mark.parametrize("temperature", [0.0, 2.0])
def test_labels_equal_direct_teacher_forcing(models, temperature: float) -> None:
    target, drafters = models
    labels = collect_labels(
        target, drafters, PROMPTS, max_new_tokens=9, temperature=temperature, batch_size=3, progress=False
    )
    assert labels.drafters == ["one", "two", "self"]
    assert labels.acceptance.shape == labels.greedy_match.shape == (len(PROMPTS), 3)
    for i, prompt in enumerate(PROMPTS):
        for k, (_, drafter) in enumerate(drafters):
            acceptance, match, continuation = _direct(target, drafter, prompt, 9, temperature)
            assert labels.continuations[i] == continuation
            assert labels.acceptance[i, k].item() == pytest.approx(acceptance, abs=1e-5)
            assert labels.greedy_match[i, k].item() == pytest.approx(match, abs=1e-6)
    # The target as its own drafter is always accepted; random drafters are not.
    assert torch.allclose(labels.acceptance[:, 2], torch.ones(len(PROMPTS)), atol=1e-5)
    assert (labels.acceptance[:, :2] < 0.9).all()


@pytest.mark.parametrize("temperature, applies", [(0.0, True), (2.0, False)])
def test_labels_with_prompt_lookup_score_what_decoding_drafts(models, temperature, applies) -> None:
    """Per prompt and position, unpadded: where decoding would draft the looked-up token (a match
    and the drafter's top probability below max_confidence), q is one-hot there: acceptance p(x),
    greedy match x == argmax p. Repetitive, ragged prompts, so the lookup fires often."""
    from specdecode.decoding.lookup import PromptLookup, lookup

    target, drafters = models
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 9, 9], [20, 21, 20], [30, 31, 32, 30, 31, 32, 30, 31, 33, 30, 31, 32, 30, 31]]
    settings = PromptLookup(max_ngram=3, min_ngram=1, max_confidence=0.9, max_temperature=1.0)
    labels = collect_labels(
        target,
        drafters,
        prompts,
        max_new_tokens=7,
        temperature=temperature,
        batch_size=4,
        progress=False,
        lookup=settings,
    )
    plain = collect_labels(
        target, drafters, prompts, max_new_tokens=7, temperature=temperature, batch_size=4, progress=False
    )
    used = 0
    for i, prompt in enumerate(prompts):
        continuation = labels.continuations[i]
        ids = torch.tensor([prompt + continuation])
        scored = slice(len(prompt) - 1, len(prompt) + len(continuation) - 1)
        for k, (_, drafter) in enumerate(drafters):
            with torch.no_grad():
                p = (target(ids).logits[0, scored] / (temperature or 1.0)).softmax(-1)
                q_logits = drafter(ids).logits[0, scored]
            q = (q_logits / (temperature or 1.0)).softmax(-1)
            acceptance, match = torch.minimum(p, q).sum(-1), (p.argmax(-1) == q.argmax(-1)).float()
            for j in range(len(continuation)):
                length = len(prompt) + j
                found, token = lookup(ids[:, :length], torch.tensor([length]), 3, 1)
                if applies and found.item() and q_logits[j].softmax(-1).max() < 0.9:
                    used += k < 2
                    acceptance[j], match[j] = p[j, token.item()], float(p[j].argmax() == token.item())
            assert labels.acceptance[i, k].item() == pytest.approx(acceptance.mean().item(), abs=1e-5)
            assert labels.greedy_match[i, k].item() == pytest.approx(match.mean().item(), abs=1e-6)
    assert (used > 10) == applies
    assert torch.equal(labels.acceptance, plain.acceptance) != applies


def test_labels_do_not_depend_on_batching(models) -> None:
    target, drafters = models
    one = collect_labels(target, drafters, PROMPTS, max_new_tokens=6, batch_size=1, progress=False)
    many = collect_labels(target, drafters, PROMPTS, max_new_tokens=6, batch_size=5, progress=False)
    assert torch.allclose(one.acceptance, many.acceptance, atol=1e-5)
    assert one.continuations == many.continuations


def test_teacher_forcing_rejects_bad_input(models) -> None:
    target, drafters = models
    with pytest.raises(ValueError, match="2 prompts but 1 continuations"):
        teacher_forced_acceptance(target, [drafters[0][1]], [[1], [2]], [[3]])
    with pytest.raises(ValueError, match="at least one token"):
        teacher_forced_acceptance(target, [drafters[0][1]], [[1]], [[]])
    with pytest.raises(ValueError, match="empty"):
        collect_labels(target, drafters, [], max_new_tokens=4, progress=False)
    with pytest.raises(ValueError, match="'wide'.*vocab"):
        collect_labels(target, [("wide", tiny_llama(1, vocab_size=80))], PROMPTS, max_new_tokens=4, progress=False)


def test_predicted_speedup_uses_cost_ratio(models) -> None:
    target, drafters = models
    labels = collect_labels(target, drafters[:2], PROMPTS[:2], max_new_tokens=5, progress=False)
    # A 4x dearer drafter with the same acceptance must be predicted slower.
    labels.acceptance[:] = torch.tensor([[0.6, 0.6], [0.5, 0.8]])
    examples = [("train", Example(f"p{i}", None, "code")) for i in range(2)]
    rows = label_rows(labels, examples, [3, 7], gammas=[4, 4], cost_ratios=[0.05, 0.2], verify_ratios=[1.3, 1.3])
    for row, alphas in zip(rows, labels.acceptance.tolist()):
        for name, alpha, c in zip(["one", "two"], alphas, [0.05, 0.2]):
            assert row["speedup"][name] == pytest.approx(predicted_speedup(alpha, 4, c, 1.3), abs=1e-5)
    assert rows[0]["speedup"]["one"] > rows[0]["speedup"]["two"]
    # Each drafter priced at its own gamma and that gamma's verify ratio.
    mixed = label_rows(labels, examples, [3, 7], gammas=[1, 6], cost_ratios=[0.05, 0.2], verify_ratios=[1.0, 1.7])
    assert mixed[1]["speedup"]["one"] == pytest.approx(predicted_speedup(0.5, 1, 0.05, 1.0), abs=1e-5)
    assert mixed[1]["speedup"]["two"] == pytest.approx(predicted_speedup(0.8, 6, 0.2, 1.7), abs=1e-5)
    with pytest.raises(ValueError, match="2 drafter columns but 1 gammas"):
        label_rows(labels, examples, [3, 7], gammas=[4], cost_ratios=[0.05, 0.2], verify_ratios=[1.3, 1.3])
    assert rows[0]["prompt"] == "p0" and rows[0]["domain"] == "code" and rows[0]["split"] == "train"
    assert rows[1]["prompt_tokens"] == 7 and rows[1]["continuation_tokens"] == 5


def _smoke_collect(tmp_path: Path, **overrides) -> CollectConfig:
    data = {
        "target": {"name": "smoke"},
        "drafters": [
            {"name": "shallow", "kind": "derived", "num_layers": 1},
            {"name": "deep", "kind": "derived", "num_layers": 3},
        ],
        "synthetic": True,
        "train_limit": 3,
        "heldout_limit": 2,
        "max_new_tokens": 4,
        "cost_ratios": {"shallow": 0.2, "deep": 0.6},
        "verify_ratio": 1.0,
        "output": str(tmp_path / "labels.jsonl"),
    }
    return from_dict(CollectConfig, data | overrides)


def test_run_collect_writes_rows_and_meta(tmp_path: Path) -> None:
    path = run_collect(_smoke_collect(tmp_path), progress=False)
    rows, meta = read_labels(path)
    assert meta_path(path).is_file() and meta["drafters"] == ["shallow", "deep"]
    assert meta["cost_ratios"] == {"shallow": 0.2, "deep": 0.6} and meta["gammas"] == {
        "shallow": 4,
        "deep": 4,
    }  # derived: 4
    assert [r["split"] for r in rows].count("train") == 9 and [r["split"] for r in rows].count("heldout") == 6
    assert {r["domain"] for r in rows} == {"code", "math", "chat"}
    for row in rows:
        assert set(row["acceptance"]) == {"shallow", "deep"}
        assert all(0 <= a <= 1 for a in row["acceptance"].values())
        assert row["speedup"]["deep"] == pytest.approx(
            predicted_speedup(row["acceptance"]["deep"], 4, 0.6, 1.0), abs=1e-4
        )
        # greedy labels: the simulated decode at gamma 4, priced at verify 1.0 + 4 drafter steps
        assert 1.0 <= row["decode_tau"]["deep"] <= 5.0
        assert row["decode_speedup"]["deep"] == pytest.approx(row["decode_tau"]["deep"] / (1.0 + 4 * 0.6), abs=1e-5)


def test_each_drafter_is_priced_at_its_stored_gamma_unless_one_is_set(tmp_path: Path) -> None:
    """gamma null: a trained drafter's speedup label uses the gamma stored with it (what decoding
    uses by default), a derived one 4; gamma=3 prices both at 3. Costs are measured (verify ratio
    per gamma)."""
    trained = derive_drafter(smoke_target(), 1)
    trained.config.specdecode_gamma = 2
    trained.save_pretrained(tmp_path / "trained")
    smoke_tokenizer().save_pretrained(tmp_path / "trained")
    drafters = [
        {"name": "trained", "kind": "pretrained", "path": str(tmp_path / "trained")},
        {"name": "derived", "kind": "derived", "num_layers": 1},
    ]
    for gamma, expected in ((None, {"trained": 2, "derived": 4}), (3, {"trained": 3, "derived": 3})):
        path = run_collect(
            _smoke_collect(
                tmp_path,
                drafters=drafters,
                gamma=gamma,
                cost_ratios=None,
                verify_ratio=None,
                cost_repeats=1,
                train_limit=1,
                heldout_limit=1,
            ),
            progress=False,
        )
        rows, meta = read_labels(path)
        assert meta["gammas"] == expected and meta["step_costs"]["trained"]["gamma"] == expected["trained"]
        for row in rows:
            for name in expected:
                assert row["speedup"][name] == pytest.approx(
                    predicted_speedup(
                        row["acceptance"][name], expected[name], meta["cost_ratios"][name], meta["verify_ratios"][name]
                    ),
                    abs=1e-4,
                )


def test_collect_config_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cost_ratios"):
        _smoke_collect(tmp_path, cost_ratios={"shallow": 0.2})
    with pytest.raises(ValueError, match=r"drafters\[\]\.name"):
        _smoke_collect(tmp_path, drafters=[{"name": "a", "kind": "derived"}, {"name": "a", "kind": "derived"}])
    with pytest.raises(ValueError, match=r"unknown domain 'poetry': no data/poetry.yaml in the config search path"):
        _smoke_collect(tmp_path, domains=["poetry"])
    with pytest.raises(ValueError, match=r"domains=\[\]: a non-empty list"):
        _smoke_collect(tmp_path, domains=[])
    with pytest.raises(ValueError, match="drafter 'x'.*drafter.path"):
        _smoke_collect(tmp_path, drafters=[{"name": "x", "kind": "pretrained"}, {"name": "y", "kind": "derived"}])
    with pytest.raises(ValueError, match="output"):
        _smoke_collect(tmp_path, output="labels.parquet")
    with pytest.raises(ValueError, match=r"gamma=65: null \(each drafter's own\) or an int in \[1, 64\]"):
        _smoke_collect(tmp_path, gamma=65)
    with pytest.raises(ValueError, match="temperature=nan"):
        _smoke_collect(tmp_path, temperature=float("nan"))
    # A missing drafter folder fails before any model loads.
    cfg = _smoke_collect(
        tmp_path,
        target={"name": "/no/such/target.gguf"},
        cost_ratios=None,
        drafters=[{"name": "a", "kind": "derived"}, {"name": "b", "path": "./no/such/drafter"}],
    )
    with pytest.raises(ValueError, match=r"drafters\[1\]\.path='./no/such/drafter'"):
        run_collect(cfg, progress=False)


def test_read_labels_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="labels='.*missing.jsonl' does not exist"):
        read_labels(tmp_path / "missing.jsonl")
    (tmp_path / "orphan.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="orphan.meta.json"):
        read_labels(tmp_path / "orphan.jsonl")


@pytest.mark.parametrize("layers", [(-1,), (1, -1)])
def test_feature_drafter_labels_equal_direct_teacher_forcing(models, layers) -> None:
    """Left-padded batched labels of a feature drafter equal an unpadded forward of it over the
    target's own features (its position t - 1 predicts token t + 1), of every layer it reads."""
    from specdecode.models.feature_drafter import derive_feature_drafter, target_features

    target, _ = models
    torch.manual_seed(4)
    drafter = derive_feature_drafter(target, 1, feature_layers=layers)
    with torch.no_grad():
        drafter.fc.weight.normal_(0, 0.4)
    # (a one-token prompt has no feature before its last token: its first label position is padding)
    prompts = [p for p in PROMPTS if len(p) >= 2]
    labels = collect_labels(target, [("feature", drafter)], prompts, max_new_tokens=7, batch_size=3, progress=False)
    for i, prompt in enumerate(prompts):
        continuation = labels.continuations[i]
        ids = torch.tensor([prompt + continuation])
        scored = torch.arange(len(prompt) - 1, len(prompt) + len(continuation) - 1)
        with torch.no_grad():
            out = target(ids, output_hidden_states=True)
            features = target_features(target, out.hidden_states, layers)
            q = drafter.logits(drafter(features[:, :-1], ids[:, 1:]))[0, scored - 1]
        p = out.logits[0, scored]
        match = (p.argmax(-1) == q.argmax(-1)).float().mean().item()
        acceptance = torch.minimum(p.softmax(-1), q.softmax(-1)).sum(-1).mean().item()
        assert labels.greedy_match[i, 0].item() == pytest.approx(match, abs=1e-6)
        assert labels.acceptance[i, 0].item() == pytest.approx(acceptance, abs=1e-5)


def test_malformed_labels_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "labels.jsonl"
    path.write_text('{"acceptance": {}}\n\n{"acceptance": {"a": 0.5\n')
    meta_path(path).write_text('{"drafters": []}')
    with pytest.raises(ValueError, match=r"labels='.*labels.jsonl' line 3 is not JSON"):
        read_labels(path)
    meta_path(path).write_text('{"drafters": [')
    with pytest.raises(ValueError, match=r"labels.meta.json' is not JSON"):
        read_labels(path)
