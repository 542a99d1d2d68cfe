"""Placeholder: completed by the afd-core work (AFDTopology)."""
