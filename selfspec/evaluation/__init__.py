"""`python -m selfspec.eval` (entry: selfspec/cli/eval.py) and the step-cost tool.

  config      EvalConfig and the prompt set's PromptSetConfig (conf/eval.yaml, conf/prompts/)
  prompt_set  the prompts an evaluation runs: file or built-in, categories, limits
  runner      the methods (HF's baselines from model/hf_baselines.py, our engine) over a prompt set, interleaved
              with selfspec/utils/timing.py
  calibration settings chosen by predicted speedup before a run: E and K (auto.enabled), decode.tree=auto
  head_cache  heads per exit layer; a missing one is trained through selfspec.training.train_head
  report      pure: per-prompt records -> summary numbers and markdown; the analytic speedup model
  plots       PNG figures; sweep   the E x K report of a multirun;  costs   `python -m selfspec.cli.costs`
"""
