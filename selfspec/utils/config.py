"""Typed configs from Hydra/OmegaConf nodes: unknown keys and bad values fail with one clear line.

`build(cls, node, group)` is what every package uses for its own dataclass configs; the entry points turn the
model / head / decode / logger groups into theirs with selfspec/cli/config.py."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf

from selfspec.errors import SelfSpecError

T = TypeVar("T")


def to_dict(node: Any) -> dict:
    if node is None:
        return {}
    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=True)  # type: ignore[return-value]
    return dict(node)


def build(cls: type[T], node: Any, group: str) -> T:
    """cls(**node), refusing keys the dataclass does not have (typos in overrides)."""
    data = to_dict(node)
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        raise SelfSpecError(f"{group}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(names))}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise SelfSpecError(f"{group}: {exc}")
