"""Domains by name for the stages: each domain's data config resolved into a stage's config, so a
stage launched on a config composed elsewhere reads the same data; and a domain's examples."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specdecode.data.config import DataConfig, as_synthetic, to_dict
from specdecode.data.config import domain_data as domain_data  # re-exported: the stages look domains up here
from specdecode.data.config import resolve_domains as resolve_domains
from specdecode.data.domains import Split, load_domain
from specdecode.data.domains import check_domains as check_domains  # re-exported: the stage configs check here
from specdecode.data.example import Example


def domain_examples(
    data: DataConfig | Mapping[str, Any], split: Split = "train", limit: int | None = None
) -> list[Example]:
    """`load_domain` with a single-domain data config's source, columns and held-out fraction."""
    if not isinstance(data, DataConfig):
        data = DataConfig(**dict(data))
    if data.is_mix:
        raise ValueError(f"data {data.name!r} is a mix of {data.domains}: read its parts one by one")
    if data.synthetic:
        data = as_synthetic(data)
    # a single domain's config holds `load_domain`'s arguments, besides its name and the smoke switch
    source = {key: value for key, value in to_dict(data).items() if key not in ("name", "synthetic")}
    return load_domain(data.name, split=split, limit=limit, **source)


def require_heldout(data: Mapping[str, Mapping[str, Any]], count: int, what: str) -> None:
    """Fail, naming the domain and how many it has, when a domain has fewer held-out prompts than `count`."""
    for name, spec in data.items():
        have = len(domain_examples(spec, "heldout", count))
        if have < count:
            raise ValueError(
                f"domain {name!r} has {have} held-out prompts but {what}={count} were asked for; "
                f"lower {what} or give the domain more data (or a larger heldout_fraction)"
            )
