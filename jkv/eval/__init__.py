"""Accuracy harness for KV selection (`jkv eval`): tasks, fidelity metric, report."""
