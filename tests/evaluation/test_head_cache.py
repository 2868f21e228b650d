"""selfspec.evaluation.head_cache: heads per exit layer from a path, the cache, training on demand, or untrained."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import make_tiny
from selfspec.errors import SelfSpecError


def test_head_cache_trains_once_per_exit_layer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from selfspec.evaluation import head_cache
    from selfspec.heads import HeadConfig, MedusaConfig, build_head, save_head
    from selfspec.training import TrainRunConfig, TrainerConfig

    m = make_tiny("llama")
    trained: list[int] = []
    recipes: list = []

    def fake_train_head(recipe, run_dir) -> Path:
        # Training's public entry point gets a typed recipe: this model, this head at this E, the given trainer.
        recipes.append(recipe)
        trained.append(recipe.head.exit_layer)
        head = build_head(HeadConfig(type="medusa", exit_layer=recipe.head.exit_layer), m.backbone)
        return save_head(head, tmp_path / f"trained-{len(trained)}", m.backbone)

    monkeypatch.setattr(head_cache, "_trainer", lambda: fake_train_head)
    root = tmp_path / "heads"
    cfg = HeadConfig(type="medusa")
    recipe = TrainRunConfig(model=m.model_config, head=None, trainer=TrainerConfig(max_steps=7))
    kw = dict(model_name="tiny", root=root, recipe=recipe)
    assert head_cache.resolve_head(m, cfg, exit_layer=2, **kw)[1] == "trained"
    assert isinstance(recipes[0], TrainRunConfig) and recipes[0].trainer.max_steps == 7
    assert recipes[0].head.type == "medusa" and recipes[0].head.path is None and recipes[0].model is m.model_config
    head, source = head_cache.resolve_head(m, cfg, exit_layer=2, **kw)
    assert source == "cache" and head.exit_layer == 2 and trained == [2]
    assert head_cache.resolve_head(m, cfg, exit_layer=3, **kw)[1] == "trained" and trained == [2, 3]
    assert list(head_cache.cached_exit_layers(root, "tiny", m.backbone, cfg, recipe)) == [2, 3]
    # other sizes are another head: not found in the cache
    assert head_cache.cached_exit_layers(root, "tiny", m.backbone, MedusaConfig(num_blocks=2), recipe) == {}
    # another training recipe is another head too (a head trained for 7 steps is not one trained for 50)
    assert head_cache.cached_exit_layers(root, "tiny", m.backbone, cfg, TrainRunConfig(model=m.model_config, head=None)) == {}
    # without a trainer: the untrained head, said so
    monkeypatch.setattr(head_cache, "_trainer", lambda: None)
    assert head_cache.resolve_head(m, cfg, exit_layer=4, **kw)[1] == "untrained"
    # a saved head must exit where head.exit_layer says
    path = str(head_cache.cached_exit_layers(root, "tiny", m.backbone, cfg, recipe)[2])
    assert head_cache.resolve_head(m, HeadConfig(path=path, exit_layer=2), **kw)[1] == "path"
    with pytest.raises(SelfSpecError, match="exits at layer 2"):
        head_cache.resolve_head(m, HeadConfig(path=path, exit_layer=3), **kw)
