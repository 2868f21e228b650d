"""The config groups every entry point shares (conf/model/, conf/head/, conf/decode/, conf/logger/), from a Hydra
node to their typed configs; unknown keys and bad values fail with one line naming the group."""

from __future__ import annotations

from selfspec.decoding.config import DecodeConfig
from selfspec.errors import SelfSpecError
from selfspec.heads import head_config_from_dict
from selfspec.model.loading import ModelConfig
from selfspec.utils.config import build, to_dict
from selfspec.utils.logger import LoggerConfig


def model_config(node):
    return build(ModelConfig, node, "model")


def head_config(node):
    """The config class registered for node.type (heads/config.py). Keys of other head types are dropped (an
    experiment's medusa sizes under head=adapter); a key no head type has is an error."""
    try:
        return head_config_from_dict(to_dict(node), group="head", other_types=True)
    except TypeError as exc:
        raise SelfSpecError(f"head: {exc}")


def decode_config(node):
    data = to_dict(node)
    return build(DecodeConfig, data, "decode")


def logger_config(node):
    return build(LoggerConfig, node, "logger")
