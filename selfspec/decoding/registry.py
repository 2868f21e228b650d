"""Drafting strategies by name: `register_proposer("name")` on a Proposer subclass makes `decode.proposer=name` draft
with it (proposers/choice.py: make_proposer).

Outside proposers/, so that DecodeConfig checks decode.proposer against the registered names without importing the
strategies (they import DecodeConfig). The strategies register themselves when selfspec.decoding.proposers is
imported, which importing selfspec does (selfspec/__init__.py -> api -> decoding/engine.py)."""

from __future__ import annotations

_REGISTRY: dict[str, type] = {}


def register_proposer(name: str):
    """Class decorator: `decode.proposer=name` drafts with this Proposer subclass."""

    def add(cls):
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return add


def unregister_proposer(name: str) -> None:
    _REGISTRY.pop(name, None)


def proposer_names() -> list[str]:
    return sorted(_REGISTRY)


def registered_proposer(name: str) -> type | None:
    """The Proposer subclass registered as `name`, or None."""
    return _REGISTRY.get(name)
