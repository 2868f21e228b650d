"""Every command line of selfspec: `python -m selfspec.cli.<name>` (train, eval, analyze and generate also as
`python -m selfspec.<name>`), and the Hydra machinery behind them (hydra_utils, sweep_summary, optuna_sweeper,
config: the shared config groups). No library package imports this one; conf/ names its Hydra callbacks."""
