"""python -m selfspec.cli.build_data [experiment=NAME] [data=...] [key=value ...]

Builds (or resumes) the training dataset of a `python -m selfspec.train` recipe and stops: no head, no
training. The dataset lands in the same cache (`$SELFSPEC_CACHE/data/<model>/<source>-<settings>/`) that
`python -m selfspec.train` with the same model and data settings then reads, so a long synthesis can run
alone (and be interrupted and restarted: data=mix keeps its progress in shards), and training starts from it.
Prints the dataset's size per source and its directory; with data.also, builds (or finds) those datasets too.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see selfspec/cli/train.py

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from selfspec.api import SelfSpecModel  # noqa: E402
from selfspec.cli.hydra_utils import run_or_exit  # noqa: E402
from selfspec.cli.train import build_configs  # noqa: E402
from selfspec.utils.paths import cache_dir, conf_dir  # noqa: E402


def build(cfg: DictConfig) -> dict:
    """-> a summary of the built (or found) dataset."""
    from selfspec.training.dataset import load_or_build  # the data stack loads when a build runs, not for --help

    c = build_configs(cfg)
    if c.trainer.num_threads:
        import torch

        torch.set_num_threads(c.trainer.num_threads)
    model = SelfSpecModel.from_pretrained(c.model, head=None)
    data, directory, cached = load_or_build(model, c.data, cache_dir(), c.model.cache_name, progress=True)
    also = []  # data.also: the datasets a training run reads beside it, each built (or found) too
    for extra in c.data.extra_datasets():
        more, more_dir, more_cached = load_or_build(model, extra, cache_dir(), c.model.cache_name, progress=True)
        also.append({"directory": str(more_dir), "cached": more_cached, "sequences": more.num_sequences,
                     "response_tokens": more.num_targets})
    return {"directory": str(directory), "cached": cached, "also": also, "sequences": data.num_sequences,
            "response_tokens": data.num_targets, "tokens": int(data.tokens.numel()), "val_prompts": len(data.val_prompts),
            "sources": data.meta.get("mix", {}).get("sources"), "sharegpt": data.meta.get("sharegpt")}


@hydra.main(config_path=str(conf_dir()), config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    s = run_or_exit(build, cfg)
    print(f"{'found' if s['cached'] else 'built'}: {s['sequences']} sequences, {s['response_tokens']} response tokens "
          f"({s['tokens']} tokens in all), {s['val_prompts']} held-out prompts")
    for name, v in (s["sources"] or {}).items():
        print(f"  {name:13s} {v['sequences']:6d} sequences {v['response_tokens']:8d} response tokens")
    if s["sharegpt"]:  # data=sharegpt: what the file gave and what this build passed through the model
        print("  sharegpt " + ", ".join(f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}" for k, v in s["sharegpt"].items()))
    print(f"dataset: {s['directory']}")
    for a in s["also"]:
        print(f"also: {a['directory']} ({'found' if a['cached'] else 'built'}: {a['sequences']} sequences, "
              f"{a['response_tokens']} response tokens)")


if __name__ == "__main__":
    main()
