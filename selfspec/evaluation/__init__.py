"""Evaluation reporting: pure functions that turn per-prompt decode results and sweep rows into summary
numbers, markdown tables (`report`) and PNG figures (`plots`). No model code lives here."""
