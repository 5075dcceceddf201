"""Accuracy harness: `oasiskv eval` runs every KV mode against its own dense anchor (see cli.py)."""
