"""The schema of the data config group (conf/data/): one domain's data, or a mix of domains; and
where a domain's config is found by name (`data/<name>.yaml` on the config search path)."""

from __future__ import annotations

import importlib.resources
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from specdecode.core.config import require, require_choice
from specdecode.core.paths import CONF_DIR
from specdecode.data.domains import (
    CHAT_TURNS,
    DOMAINS,
    SOURCES,
    check_domain_name,
    check_domains,
    check_heldout_fraction,
)
from specdecode.data.files import FILE_SUFFIXES, file_suffix


@dataclass
class DataConfig:
    """A domain: its name and where its prompts come from (`load_domain`'s arguments). With `domains`,
    a mix: those domains interleaved, each read through its own data config."""

    name: str = "code"
    source: str = "embedded"
    path: str | None = None
    hf_id: str | None = None
    hf_name: str | None = None
    hf_split: str = "train"
    revision: str | None = None
    prompt_column: str = "prompt"
    response_column: str | None = None
    heldout_fraction: float = 0.1
    # all: the embedded chat data's training prompts go on with its conversations' later user turns.
    chat_turns: str = "opening"
    # Smoke runs: embedded data is replaced by tiny synthetic examples.
    synthetic: bool = False
    # A mix's domains; null (or [name]) is this config's own domain.
    domains: list[str] | None = None
    # The mix's domains' data configs by name, resolved from the config search path where not given.
    members: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_domain_name("data.name", self.name)
        require_choice(f"data.source (domain {self.name!r})", self.source, SOURCES)
        if self.source == "file":
            key, suffixes = f"data.path (domain {self.name!r})", ", ".join(FILE_SUFFIXES)
            require(bool(self.path), key, self.path, f"source 'file' needs a path to a {suffixes} file")
            path = Path(str(self.path)).expanduser()
            require(path.is_file(), key, self.path, "does not exist")
            require(file_suffix(path) in FILE_SUFFIXES, key, self.path, f"a {suffixes} file")
            require(path.stat().st_size > 0, key, self.path, "is empty")
        if self.source == "hf":
            require(
                bool(self.hf_id), f"data.hf_id (domain {self.name!r})", self.hf_id, "source 'hf' needs a dataset id"
            )
        require(
            bool(self.prompt_column), f"data.prompt_column (domain {self.name!r})", self.prompt_column, "a column name"
        )
        require_choice("data.chat_turns", self.chat_turns, CHAT_TURNS)
        check_heldout_fraction(self.heldout_fraction, "data.heldout_fraction")
        if self.domains is not None:
            self.domains = check_domains(self.domains, "data.domains")
            if self.domains == [self.name]:
                self.domains = None
        if self.is_mix:
            self._resolve_members()

    @property
    def is_mix(self) -> bool:
        return self.domains is not None

    @property
    def domain_names(self) -> list[str]:
        """The domains this config's examples carry: the mix's, or its own name."""
        return list(self.domains) if self.domains is not None else [self.name]

    def parts(self) -> list[DataConfig]:
        """One single-domain config per domain: the mix's members, or this config itself."""
        if not self.is_mix:
            return [self]
        return [DataConfig(**self.members[name]) for name in self.domain_names]

    def _resolve_members(self) -> None:
        synthetic = self.synthetic or self.source == "synthetic"
        self.members = resolve_domains(self.domain_names, self.members, synthetic=synthetic)
        for name, member in self.members.items():
            require(
                not member.get("domains"), f"data.domains ({self.name!r})", name, "a single domain, not another mix"
            )


def resolve_domains(
    names: Sequence[str], given: Mapping[str, Any] | None = None, *, synthetic: bool = False
) -> dict[str, dict[str, Any]]:
    """Each domain's data config as plain values: `given[name]` where present, else looked up on the
    search path; `synthetic` swaps embedded data for synthetic examples."""
    resolved = {}
    for name in names:
        data = DataConfig(**dict(given[name])) if given and name in given else domain_data(name)
        if data.name != name:
            raise ValueError(f"data.{name}: its config names domain {data.name!r}")
        resolved[name] = to_dict(replace(data, synthetic=True) if synthetic else data)
    return resolved


def as_synthetic(data: DataConfig) -> DataConfig:
    """`data` with the smoke runs' synthetic examples in place of embedded data (other sources kept)."""
    return replace(data, source="synthetic", synthetic=False) if data.source == "embedded" else data


def to_dict(data: DataConfig) -> dict[str, Any]:
    """A single-domain config as plain values, as it goes into a stage's resolved config."""
    return {f.name: getattr(data, f.name) for f in fields(DataConfig) if f.name not in ("domains", "members")} | (
        {"domains": list(data.domains or []), "members": asdict(data)["members"]} if data.is_mix else {}
    )


def search_path(extra: Iterable[str | Path] = ()) -> list[Path]:
    """The config folders a domain is looked up in: the running Hydra app's, this package's conf/, `extra`."""
    folders: list[Path] = []
    try:
        from hydra.core.hydra_config import HydraConfig

        sources = HydraConfig.get().runtime.config_sources if HydraConfig.initialized() else []
    except ValueError:
        sources = []
    for source in sources:
        if source.schema == "file":
            folders.append(Path(source.path))
        elif source.schema == "pkg":
            try:
                folders.append(Path(str(importlib.resources.files(source.path))))
            except (ModuleNotFoundError, TypeError):
                continue
    folders += [CONF_DIR, *(Path(str(e).removeprefix("file://")) for e in extra)]
    return list(dict.fromkeys(p.resolve() for p in folders))


def domain_data(name: str, extra: Iterable[str | Path] = ()) -> DataConfig:
    """The data config of domain `name`: `data/<name>.yaml` on the search path. A ValueError names the
    folders searched where none defines it, both files where two define it differently."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"domain name {name!r} must be a non-empty string")
    folders = search_path(extra)
    found = [(folder / "data" / f"{name}.yaml") for folder in folders]
    found = [path for path in found if path.is_file()]
    if not found:
        raise ValueError(
            f"unknown domain {name!r}: no data/{name}.yaml in the config search path "
            f"{[str(f) for f in folders]}; define it there (name, source, path or hf_id, prompt_column) "
            "and add its folder with hydra.searchpath=[file:///your/conf]"
        )
    configs = [(path, _load(path, name)) for path in found]
    first_path, first = configs[0]
    for path, other in configs[1:]:
        if other != first:
            builtin = " (a built-in domain: give yours another name)" if name in DOMAINS else ""
            raise ValueError(
                f"domain {name!r} is defined twice, differently: {first_path} (source {first.source!r}) "
                f"and {path} (source {other.source!r}){builtin}"
            )
    return first


def _load(path: Path, name: str) -> DataConfig:
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a data config must be a mapping (name, source, ...), got {type(raw).__name__}")
    values: dict[str, Any] = {str(k): v for k, v in raw.items() if k != "defaults"}
    values.setdefault("name", name)
    if values["name"] != name:
        raise ValueError(f"{path}: name {values['name']!r} differs from the file's name {name!r}")
    try:
        return DataConfig(**values)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: {error}") from None
