"""`data=mix`: training data from a weighted mix of prompt sources, built in resumable stages (build.py), from
prompts with real contexts (contexts.py: documents, package docs, code, translation pairs from gettext catalogues,
catalogs.py). The prompt loaders and the evaluation-prompt exclusion it shares with evaluation are selfspec/data/."""
