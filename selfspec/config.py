"""Typed configs from Hydra/OmegaConf nodes: unknown keys and bad values fail with one clear line."""

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


def model_config(node):
    from selfspec.model.loading import ModelConfig

    return build(ModelConfig, node, "model")


def head_config(node):
    """The config class registered for node.type (heads/config.py). Keys of other head types are dropped (an
    experiment's medusa sizes under head=adapter); a key no head type has is an error."""
    from selfspec.heads import head_config_from_dict

    try:
        return head_config_from_dict(to_dict(node), group="head", other_types=True)
    except TypeError as exc:
        raise SelfSpecError(f"head: {exc}")


def decode_config(node):
    from selfspec.decoding.config import DecodeConfig

    data = to_dict(node)
    return build(DecodeConfig, data, "decode")


def logger_config(node):
    from selfspec.logger import LoggerConfig

    return build(LoggerConfig, node, "logger")
