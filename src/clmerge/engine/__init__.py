"""The continual loop, evaluation, heads, checkpoint/resume, dry runs, task orders and the export of a run.

Layer: above methods; the highest layer of the library proper (docs/architecture.md).
"""
