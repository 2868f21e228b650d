"""Offline self-distillation of exit heads (`python -m selfspec.train`).

  synthesis   the target writes prompts (Magpie) and answers them; its top-k distribution is recorded
  mix/        data=mix: prompts with real contexts from weighted sources, built in resumable stages
  dataset     sequences + soft targets, cached on disk by model fingerprint and data settings
  features    layer-E hidden states, cached per exit layer
  loss        soft cross-entropy against the full model (+ optional hard labels)
  loop        the optimizer loop (no I/O: hooks decide what logging and checkpointing mean)
  validation  real self-speculative decoding vs the autoregressive path (and pool_stats, evaluation's too)
  checkpoint  atomic checkpoints with optimizer, scheduler and RNG states
  distributed torchrun data parallelism over the trainable parameters
  run         one job end to end from a typed recipe (the command line makes it of conf/train.yaml:
              selfspec/cli/train.py); `train_head(recipe) -> head dir` for other tools
"""

from selfspec.training.config import DataConfig, TrainerConfig, TrainRunConfig


def train_head(recipe: TrainRunConfig, run_dir=None):
    """Train a head from a typed recipe -> its directory (see selfspec.training.run.train_head)."""
    # the training machinery loads on the first call: `import selfspec.training` (its configs) stays light
    from selfspec.training.run import train_head as _train_head

    return _train_head(recipe, run_dir)


__all__ = ["DataConfig", "TrainRunConfig", "TrainerConfig", "train_head"]
