"""Head configs and the head registry (peft's `LoraConfig` style: one dataclass per head type).

`HeadConfig` holds what every head has (type, exit layer, a saved directory, the draft vocabulary); a head type
subclasses it with its own fields, validated in `__post_init__`, and registers itself with its head class:

    @dataclass
    class MedusaConfig(HeadConfig):
        type: str = "medusa"
        num_blocks: int = 1

    @register_head("medusa", MedusaConfig)
    class MedusaHead(ExitHead): ...

`make_head_config(type, **fields)` and `head_config_from_dict(d)` build the right class from a type name (Hydra's
`head=medusa head.num_blocks=2`, `from_pretrained(head="medusa", num_blocks=2)`, a saved head_config.json).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from selfspec.errors import SelfSpecError, check, is_int, is_number
from selfspec.model.quant import PRECISIONS


@dataclass
class HeadConfig:
    type: str = "lens"
    exit_layer: int | None = None  # None: the default for the model (a fifth of its depth)
    path: str | None = None  # a saved head directory; overrides type and sizes
    draft_vocab: int | None = None  # score only the N most frequent tokens when drafting
    # The draft pass's weights: "full" (the model's), or copies of the same weights in "int8" / "int4" made at load,
    # or "int4_mlp" (the MLP in int4, the rest in int8; model/quant.py); verification always runs in full precision. None: a saved head's own setting, else full.
    draft_precision: str | None = None
    # Load a saved head (path) even on a model its fingerprint says is another one (model/identity.py); not saved
    allow_other_model: bool = False

    def __post_init__(self):
        if self.path is None:
            check(self.type in _REGISTRY, f"head.type={self.type!r}: allowed {', '.join(head_types())} (or head.path=DIR)")
        else:
            check(isinstance(self.path, (str, os.PathLike)), f"head.path={self.path!r}: must be a directory path")
            self.path = str(self.path)
        check(self.exit_layer is None or is_int(self.exit_layer),
              f"head.exit_layer={self.exit_layer!r}: must be an integer (or null for the model's default)")
        check(self.draft_precision is None or self.draft_precision in PRECISIONS,
              f"head.draft_precision={self.draft_precision!r}: allowed {', '.join(PRECISIONS)}")
        check(self.draft_vocab is None or is_int(self.draft_vocab) and self.draft_vocab >= 1,
              f"head.draft_vocab={self.draft_vocab!r}: must be an integer >= 1 (or null for the full vocabulary)")
        check(isinstance(self.allow_other_model, bool), f"head.allow_other_model={self.allow_other_model!r}: allowed true or false")

    def size_limits(self, backbone) -> dict[str, tuple[int, int, str]]:
        """The allowed range of each size of this head on `backbone` (num_layers, hidden_size, vocab_size, ...):
        {field: (lowest, highest, what the highest is)}. `check_head_sizes` checks them before any of the head's
        modules is built, so a size from a user or a file cannot allocate more than the model itself. A head type
        with sizes of its own extends this (super().size_limits(backbone) | {...})."""
        return {"draft_vocab": (1, backbone.vocab_size, "its vocabulary")}


def check_head_sizes(cfg: HeadConfig, backbone, where: str = "head") -> None:
    """One error line naming the first size of `cfg` outside its range for this model (see size_limits)."""
    for name, (lo, hi, what) in cfg.size_limits(backbone).items():
        value = getattr(cfg, name, None)
        if value is None:
            continue
        check(is_int(value) and lo <= value <= hi,
              f"{where}.{name}={value!r}: must be an integer in [{lo}, {hi}] for this model ({hi} = {what})")


def check_int_field(group: str, name: str, value, minimum: int, nullable: bool = False) -> None:
    """A head's integer size: one line naming head.<name> when it is not an integer >= minimum."""
    ok = (nullable and value is None) or (is_int(value) and value >= minimum)
    check(ok, f"{group}.{name}={value!r}: must be an integer >= {minimum}" + (" (or null)" if nullable else ""))


def check_number_field(group: str, name: str, value, above: float) -> None:
    check(is_number(value) and value > above, f"{group}.{name}={value!r}: must be a number > {above}")


# ------------------------------------------------------------------------------------------------ the registry
@dataclass(frozen=True)
class HeadSpec:
    type: str
    config_class: type
    head_class: type


_REGISTRY: dict[str, HeadSpec] = {}


def register_head(type_name: str, config_class: type = HeadConfig):
    """Class decorator: make `type_name` a head type built from `config_class` (a HeadConfig subclass)."""
    check(issubclass(config_class, HeadConfig), f"register_head({type_name!r}): {config_class.__name__} is not a HeadConfig")

    def decorate(head_class: type) -> type:
        old = _REGISTRY.get(type_name)
        if old is not None and old.head_class.__qualname__ != head_class.__qualname__:
            raise SelfSpecError(f"head type {type_name!r} is already registered ({old.head_class.__qualname__})")
        _REGISTRY[type_name] = HeadSpec(type_name, config_class, head_class)
        return head_class

    return decorate


def unregister_head(type_name: str) -> None:
    """Forget a head type (tests and notebooks that register one for a while)."""
    _REGISTRY.pop(type_name, None)


def head_types() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def head_spec(type_name: str) -> HeadSpec:
    check(type_name in _REGISTRY, f"head.type={type_name!r}: allowed {', '.join(head_types())}")
    return _REGISTRY[type_name]


def config_fields(config_class: type) -> list[str]:
    return [f.name for f in fields(config_class)]


def make_head_config(type: str = "lens", group: str = "head", **values) -> HeadConfig:
    """The registered config class of `type` with `values`; a key that class does not have is one error line
    that lists the allowed ones. With a `path` and an unknown type, the plain HeadConfig (the saved head
    brings its own type)."""
    values = {k: v for k, v in values.items()}
    if type in _REGISTRY:
        cls = _REGISTRY[type].config_class
    else:
        check(values.get("path") is not None, f"{group}.type={type!r}: allowed {', '.join(head_types())} (or {group}.path=DIR)")
        cls = HeadConfig
    names = config_fields(cls)
    unknown = sorted(set(values) - set(names))
    check(not unknown, f"{group}: unknown key(s) {', '.join(unknown)} for head type {type!r}; allowed: {', '.join(sorted(names))}")
    return cls(type=type, **values)


def head_config_from_dict(d: dict, group: str = "head", strict: bool = True, other_types: bool = False) -> HeadConfig:
    """From a flat dict (a Hydra node, a saved head_config.json).

    strict=False drops every key the type does not have (heads saved before the per-type configs stored every
    type's fields). other_types=True drops only keys that another registered type has: Hydra composes an
    experiment's sizes for its own head type (experiment=default sets head.num_blocks for medusa) also under
    head=adapter; a key no head type has is still an error (a typo)."""
    d = dict(d)
    type_name = d.pop("type", "lens")
    cls = _REGISTRY[type_name].config_class if type_name in _REGISTRY else HeadConfig
    mine = set(config_fields(cls))
    if not strict:
        d = {k: v for k, v in d.items() if k in mine}
    elif other_types:
        others = {k for spec in _REGISTRY.values() for k in config_fields(spec.config_class)} - mine
        d = {k: v for k, v in d.items() if k not in others}
    return make_head_config(type_name, group=group, **d)


def as_head_config(cfg: HeadConfig) -> HeadConfig:
    """cfg as its type's registered class: a plain HeadConfig(type="medusa", ...) gets medusa's defaults."""
    cls = head_spec(cfg.type).config_class
    if type(cfg) is cls:
        return cfg
    common = {f.name: getattr(cfg, f.name) for f in fields(HeadConfig)}
    return cls(**common)
