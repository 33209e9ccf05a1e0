"""EAGLE-3 drafters trained by the distillation job (`drafter=eagle3`): what the job caches and
trains, the saved folder decoding exactly in our loop (greedy and sampled), its engine exports, and
an evaluation routing between it and a feature drafter. The architecture: tests/test_eagle3.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdecode import autoregressive_generate, speculative_generate
from specdecode.decoding.drafting import FeatureDrafting
from specdecode.decoding.lookup import DEFAULT_LOOKUP
from specdecode.decoding.sampling import SamplingParams
from specdecode.evaluation.config import EvalConfig
from specdecode.evaluation.suite import run_eval
from specdecode.models.config import TargetConfig
from specdecode.models.draft_vocab import draft_vocab_ids
from specdecode.models.eagle3_drafter import Eagle3Drafter, derive_eagle3_drafter, teacher_layers
from specdecode.models.eagle_export import export_drafter
from specdecode.models.feature_drafter import derive_feature_drafter, target_features
from specdecode.models.loading import load_model
from specdecode.models.smoke import smoke_target, smoke_tokenizer
from specdecode.training.config import TrainJobConfig
from specdecode.training.feature_training import FeatureDrafterLogits, regression_weight
from specdecode.training.job import run_distill
from specdecode.training.store import read_store
from tests.models_for_tests import tiny_llama
from tests.test_engine_export import assert_engine_runs_eagle3
from tests.test_evaluation import FixedRouter
from tests.test_train import smoke_cfg
from tests.test_verify import EAGER_LOOKUP, SIGNIFICANCE, VOCAB, exact_joint, g_test_pvalue, sampled_joint

LAYERS = (1, 2, 3)  # the smoke target has 4 layers: too few for the engines' default (2, L // 2, L - 3)
EAGLE3 = ["drafter=eagle3", f"drafter.feature_layers=[{','.join(map(str, LAYERS))}]", "drafter.draft_vocab=96"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TrainJobConfig, dict]:
    """One job on the smoke target: its output folder, config and metrics."""
    root = tmp_path_factory.mktemp("eagle3")
    cfg = smoke_cfg(
        root,
        *EAGLE3,
        "skinny_matmul=false",
        "train.max_steps=20",
        "train.eval_every=10",
        "train.lr=2e-2",
        "train.seq_source=target",
        "train.seq_temperatures=[0.0]",
        # The tiny random target's argmax is near-uniform noise: held-out greedy acceptance stays at
        # 0.007-0.027 whatever the training (seeds 0-4), so the best step is chosen by Σ min(p, q) at
        # T = 1, which training raises from 0.026 to 0.083 or more.
        "train.select_temperature=1.0",
        "train.gamma_candidates=[1,3]",
    )
    return root, cfg, run_distill(cfg)


def test_the_job_trains_an_eagle3_drafter(trained) -> None:
    """Held-out acceptance rises; the cache holds the three raw target states and, in the fed-back
    slot, the target's last state (the teacher's input); the head and its final norm trained while
    the embeddings stayed the target's; the folder loads back as an EAGLE-3 drafter of those layers."""
    root, _, metrics = trained
    assert metrics["drafter_kind"] == "eagle3" and metrics["feature_layers"] == list(LAYERS)
    # progress in held-out Σ min(p, q) (+0.057 at least over seeds 0-4) and in greedy agreement on
    # the training data (+0.044 at least)
    first, last = metrics["history"][0], metrics["history"][-1]
    assert metrics["selection_metric"] != "greedy acceptance"
    assert metrics["acceptance_best"] > metrics["acceptance_before"] + 0.04
    assert last["train_greedy"] > first["train_greedy"] + 0.02

    target = smoke_target()
    (path,) = (root / "cache").glob("distill-train-*")
    cache = read_store(path)
    tokens = torch.tensor([cache.sequences[0].tokens])
    with torch.no_grad():
        states = target(tokens, output_hidden_states=True).hidden_states
    expected = torch.cat([states[i][0] for i in (*LAYERS, -1)], dim=-1)
    # the sequence's last token was never fed to the target that wrote it: its row is zero
    torch.testing.assert_close(cache.sequence_features(0)[:-1].float(), expected[:-1], atol=2e-2, rtol=1e-2)

    drafter, tokenizer = load_model(root / "out" / "drafter", skinny_matmul=False)
    assert isinstance(drafter, Eagle3Drafter) and drafter.feature_layers == LAYERS and len(tokenizer) == 259
    head, ids = drafter.get_output_embeddings(), draft_vocab_ids(drafter)
    assert len(ids) == 96 and drafter.config.specdecode_gamma == metrics["gamma"]["chosen"]
    assert not torch.equal(head.weight, target.lm_head.weight[ids]) and not torch.equal(
        head.norm.weight, torch.ones_like(head.norm.weight)
    )
    assert torch.equal(drafter.get_input_embeddings().weight, target.get_input_embeddings().weight)
    assert "EAGLE-3 drafter" in (root / "out" / "drafter" / "README.md").read_text()
    assert json.loads((root / "out" / "metrics.json").read_text())["drafter_kind"] == "eagle3"


def test_a_job_fine_tunes_a_trained_eagle3_folder(trained, tmp_path) -> None:
    """`drafter=pretrained` on an EAGLE-3 folder (how the demo's domain drafters start from the
    generic one): the cache keeps its layers' teacher layout, and the result is an EAGLE-3 drafter."""
    root, _, _ = trained
    cfg = smoke_cfg(
        tmp_path,
        "drafter=pretrained",
        f"drafter.path={root / 'out' / 'drafter'}",
        "drafter.draft_vocab=null",
        "skinny_matmul=false",
        "train.max_steps=2",
        "train.eval_every=2",
        "train.gamma_candidates=[]",
    )
    metrics = run_distill(cfg)
    assert metrics["drafter_kind"] == "eagle3" and metrics["feature_layers"] == list(LAYERS)
    (path,) = (tmp_path / "cache").glob("distill-train-*")
    assert read_store(path).features.shape[1] == 4 * 64
    assert isinstance(load_model(tmp_path / "out" / "drafter", skinny_matmul=False)[0], Eagle3Drafter)


@pytest.mark.parametrize("gamma", [1, 4])
@pytest.mark.parametrize("lookup", [DEFAULT_LOOKUP, None], ids=["lookup", "no-lookup"])
def test_the_trained_drafter_decodes_as_the_target_alone(trained, gamma, lookup) -> None:
    root, _, _ = trained
    target, tokenizer = load_model("smoke")
    drafter, _ = load_model(root / "out" / "drafter", skinny_matmul=False)
    texts = ["def add(a, b):", "x = [1, 2, 3]\nfor i in x:\n    print(i)\n# and again: for i in x", "a"]
    prompts = [tokenizer.encode(t) for t in texts]
    alone = autoregressive_generate(target, prompts, max_new_tokens=20, eos_token_ids=[])
    ours = speculative_generate(
        target, drafter, prompts, gamma=gamma, max_new_tokens=20, eos_token_ids=[], prompt_lookup=lookup
    )
    assert ours.sequences == alone.sequences and ours.stats.drafted > 0
    sampled = speculative_generate(
        target, drafter, prompts, gamma=gamma, max_new_tokens=20, temperature=0.8, eos_token_ids=[], seed=0
    )
    assert [len(s) for s in sampled.sequences] == [20, 20, 20] and sampled.stats.drafted > 0


def test_the_cpu_kernel_choice_times_an_eagle3_drafter_and_it_stays_exact(trained) -> None:
    """`load_model(skinny_matmul=None)` times a drafter folder's forward on tokens; an
    EAGLE-3 drafter's layer reads `[embedding; g]`, so it is timed as a drafting pass over zero target
    states (`timed_module`). Whatever kernels that picks, greedy decoding stays the target's."""
    import specdecode.models.kernel_choice as kernel_choice

    root, _, _ = trained
    drafter, _ = load_model(root / "out" / "drafter", skinny_matmul=None)
    assert isinstance(drafter, Eagle3Drafter) and len(list((kernel_choice.kernel_cache_dir()).glob("*.json"))) >= 1
    target, tokenizer = load_model("smoke", skinny_matmul=False)
    prompts = [tokenizer.encode("def add(a, b):"), tokenizer.encode("x = 1")]
    ours = speculative_generate(target, drafter, prompts, gamma=3, max_new_tokens=12, eos_token_ids=[])
    assert ours.sequences == autoregressive_generate(target, prompts, max_new_tokens=12, eos_token_ids=[]).sequences


def test_training_on_the_cache_layout_is_what_decoding_draws_from() -> None:
    """The job's forward (`FeatureDrafterLogits`) over the cache's features (`teacher_layers`: the
    target's last state in the fed-back slot) gives, at each drafting step, the q decoding drew from.
    Fails if training feeds the drafter the teacher's slot, skips its head's norm, or unrolls
    otherwise than decoding runs."""
    target = tiny_llama(4, seed=0)
    drafter = _random_eagle3(target, draft_vocab=list(range(0, 64, 3)))
    gamma, records, original = 3, [], FeatureDrafting.propose

    def recording(self, tokens, lengths, max_length, gamma_, params, generator):
        draft, q = original(self, tokens, lengths, max_length, gamma_, params, generator)
        records.append((tokens.clone(), lengths.clone(), draft.clone(), q.clone()))
        return draft, q

    prompts = [[3, 9, 4, 4], [7, 1, 1, 5, 2, 8, 6], [11, 2]]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FeatureDrafting, "propose", recording)
        speculative_generate(
            target, drafter, prompts, gamma=gamma, max_new_tokens=8, temperature=1.0, seed=0, prompt_lookup=None
        )
    ids, cached_layers = draft_vocab_ids(drafter), teacher_layers(LAYERS, 4)
    with torch.no_grad():
        for tokens, lengths, draft, q in records[:3]:
            for row in range(tokens.shape[0]):
                length = int(lengths[row])
                sequence = torch.cat([tokens[row, :length], draft[row, : gamma - 1]]).unsqueeze(0)
                states = target(sequence, output_hidden_states=True).hidden_states
                cached = target_features(target, states, cached_layers)
                positions = torch.zeros_like(sequence, dtype=torch.bool)
                positions[0, length - 1 :] = True  # draft j + 1 is scored at standard position length - 1 + j
                logits, _ = FeatureDrafterLogits(drafter, gamma)(sequence, torch.ones_like(sequence), cached, positions)
                for j in range(gamma):
                    torch.testing.assert_close(q[row, j, ids], logits[j, j].softmax(-1), atol=1e-4, rtol=1e-4)


def test_an_eagle3_drafter_has_no_feature_regression() -> None:
    target = tiny_llama(4, seed=0)
    eagle3, feature = _random_eagle3(target), derive_feature_drafter(target)
    assert regression_weight(None, eagle3) == 0 and regression_weight(0, eagle3) == 0
    assert regression_weight(None, feature) == 1 and regression_weight(0.5, feature) == 0.5
    with pytest.raises(ValueError, match="feature_loss_weight=1.0: an EAGLE-3 drafter's outputs are its own"):
        regression_weight(1.0, eagle3)
    with pytest.raises(ValueError, match="train.feature_loss_weight=1.0: must be null or 0 with drafter.kind='eagle3'"):
        smoke_cfg(Path("unused"), *EAGLE3, "train.feature_loss_weight=1.0")


@pytest.mark.parametrize(
    "params, draft_vocab",
    [(SamplingParams(1.0), None), (SamplingParams(0.7, top_k=2), [0, 2, 3])],
    ids=["t1.0", "t0.7-k2-vocab3"],
)
def test_sampled_output_follows_the_target_with_an_eagle3_drafter(params, draft_vocab) -> None:
    """tests/test_verify.py's Monte-Carlo G-test with an EAGLE-3 drafter, its drafts alone and mostly looked up."""
    target = tiny_llama(4, seed=11, vocab_size=VOCAB, init=0.3)
    drafter = _random_eagle3(target, draft_vocab=draft_vocab, std=0.3)
    exact = exact_joint(target, params)
    assert g_test_pvalue(sampled_joint(target, drafter, params, seed=1, lookup=None), exact) > SIGNIFICANCE
    assert g_test_pvalue(sampled_joint(target, drafter, params, seed=3, lookup=EAGER_LOOKUP), exact) > SIGNIFICANCE


@pytest.mark.parametrize("format", ["vllm-eagle3", "sglang-eagle3"])
def test_the_trained_drafter_exports_to_both_engines(trained, tmp_path, format) -> None:
    root, _, _ = trained
    drafter, _ = load_model(root / "out" / "drafter", skinny_matmul=False)
    target = smoke_target()
    folder = export_drafter(drafter, target, tmp_path / "out", format)
    assert assert_engine_runs_eagle3(target, drafter, folder, format)["draft_vocab_size"] == 96


def test_a_routed_evaluation_over_a_feature_and_an_eagle3_drafter(trained, tmp_path) -> None:
    root, _, _ = trained
    feature = tmp_path / "feature"
    derive_feature_drafter(smoke_target(), draft_vocab=list(range(0, 259, 2))).save_pretrained(feature)
    smoke_tokenizer().save_pretrained(feature)
    cfg = EvalConfig(
        target=TargetConfig(name="smoke"),
        skinny_matmul=False,
        methods=["autoregressive", "generic", "specialized", "routed", "oracle"],
        drafters={"generic": str(feature), "code": str(root / "out" / "drafter")},
        router_dir="unused-by-the-fake-loader",
        domains=["code"],
        synthetic=True,
        prompts_per_domain=2,
        max_new_tokens=6,
        gamma=2,
        temperatures=[0.0],
        batch_sizes=[1, 2],
        output_dir=str(tmp_path / "eval"),
    )
    rows = run_eval(cfg, router_loader=lambda path: FixedRouter("generic", "code", cut=30))["rows"]
    methods = {r["method"] for r in rows}
    assert {"generic", "specialized:code", "routed", "oracle"} <= methods
    assert all(r["exact_match"] == 1.0 for r in rows)


def _random_eagle3(target: torch.nn.Module, draft_vocab=None, std: float = 0.4) -> Eagle3Drafter:
    """An EAGLE-3 drafter reading `LAYERS` with a random fusion and its layer and head moved off their
    initialisation, so its drafts depend on what it reads and are neither always right nor trivial."""
    torch.manual_seed(5)
    drafter = derive_eagle3_drafter(target, feature_layers=LAYERS, draft_vocab=draft_vocab)
    with torch.no_grad():
        drafter.fc.weight.normal_(0, std)
        for p in [*drafter.layer.parameters(), *drafter.get_output_embeddings().parameters()]:
            p.add_(torch.randn_like(p) * 0.1)
    return drafter
