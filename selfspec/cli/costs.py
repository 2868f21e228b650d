"""python -m selfspec.cli.costs model=smollm2_135m costs.repeats=20       # config: conf/costs.yaml

Step costs relative to one autoregressive step, measured on the model and written into the run dir as costs.json and
costs.md (what they are: selfspec/evaluation/costs.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import hydra

from selfspec.api import SelfSpecModel
from selfspec.cli.config import model_config
from selfspec.cli.hydra_utils import run_or_exit
from selfspec.errors import check
from selfspec.evaluation.costs import CostsConfig, build_cost_heads, costs_markdown, measure_costs
from selfspec.utils.config import build
from selfspec.utils.io import atomic_write_json, atomic_write_text
from selfspec.utils.paths import conf_dir

log = logging.getLogger(__name__)


def run(cfg) -> dict:
    from hydra.core.hydra_config import HydraConfig

    c = build(CostsConfig, cfg.costs, "costs")
    mcfg = model_config(cfg.model)
    model = SelfSpecModel.from_pretrained(mcfg, head=None)
    L = model.backbone.num_layers
    exit_layers = [e for e in c.exit_layers if 1 <= e < L]
    if len(exit_layers) < len(c.exit_layers):
        log.warning("costs.exit_layers: dropped %s (this model has %d layers)",
                    [e for e in c.exit_layers if e not in exit_layers], L)
    check(bool(exit_layers), f"costs.exit_layers={c.exit_layers}: none in [1, {L - 1}] for this model")
    heads = build_cost_heads(model, c.head_types, exit_layers, c.draft_vocab)
    costs = measure_costs(model.backbone, heads, exit_layers, c.draft_lens, context=c.context, repeats=c.repeats)
    costs["model"] = mcfg.name
    md = costs_markdown(costs, title=f"Step costs: {mcfg.name}")
    out = Path(HydraConfig.get().runtime.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "costs.json", costs)
    atomic_write_text(out / "costs.md", md)
    print(md)
    print(f"written: {out / 'costs.json'}, {out / 'costs.md'}")
    return costs


@hydra.main(config_path=str(conf_dir()), config_name="costs", version_base="1.3")
def main(cfg) -> None:
    run_or_exit(run, cfg)


if __name__ == "__main__":
    main()
