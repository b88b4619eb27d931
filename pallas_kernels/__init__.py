"""Pallas GPU kernels (Triton lowering), one module per kernel family.

This package knows nothing about datasets or replay: every module is usable on
its own. Each family exposes a frozen config dataclass, a heuristic that picks a
config from shapes, and a launcher taking `interpret=` and `config=`.
"""
