"""Helpers every layer may use: safe YAML/JSON I/O and atomic writes, input and output path rules, thread
settings, precision, progress, optional extras.

Layer: the lowest, with ``errors`` and ``registry`` (docs/architecture.md).
"""
