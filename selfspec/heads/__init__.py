"""Exit heads, their configs and registry, and their save/load.

Every module of this package is imported here, so a head type registers itself by being a module in it:
one module (config dataclass + head class + `@register_head`) and one conf/head/<type>.yaml. See
ARCHITECTURE.md, "How to add a head type".
"""

from __future__ import annotations

import importlib
import pkgutil

from selfspec.heads.base import (ExitHead, check_exit_layer, default_draft_vocab, default_exit_layer, draft_vocab_from_counts,
                                 resolve_exit_layer)
from selfspec.heads.config import (
    HeadConfig,
    as_head_config,
    head_config_from_dict,
    head_spec,
    head_types,
    make_head_config,
    register_head,
    unregister_head,
)
from selfspec.heads.files import save_head
from selfspec.heads.saving import build_head, load_head, read_head_config

_INFRA = {"base", "config", "files", "saving", "export"}
for _m in pkgutil.iter_modules(__path__):
    if _m.name not in _INFRA:
        importlib.import_module(f"{__name__}.{_m.name}")

from selfspec.heads.adapter import AdapterConfig, AdapterHead  # noqa: E402
from selfspec.heads.lens import LensHead  # noqa: E402
from selfspec.heads.lora import LoraHead, LoraHeadConfig  # noqa: E402
from selfspec.heads.medusa import MedusaConfig, MedusaHead  # noqa: E402

__all__ = [
    "ExitHead", "HeadConfig", "register_head", "unregister_head", "head_types", "head_spec", "make_head_config", "head_config_from_dict",
    "as_head_config", "build_head", "save_head", "load_head", "read_head_config", "default_exit_layer",
    "check_exit_layer", "resolve_exit_layer", "default_draft_vocab", "draft_vocab_from_counts",
    "LensHead", "MedusaHead", "MedusaConfig", "AdapterHead", "AdapterConfig", "LoraHead", "LoraHeadConfig",
]
