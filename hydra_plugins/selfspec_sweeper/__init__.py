"""selfspec's Hydra plugins (Hydra loads sweepers only from the hydra_plugins namespace package)."""
