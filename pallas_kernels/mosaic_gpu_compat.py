"""The one place where Mosaic GPU's API differs between the jax releases the
project supports (0.11.2 on the GPU machine, 0.12 in CI)."""

from __future__ import annotations

from typing import Any

from jax.experimental.pallas import mosaic_gpu as plgpu


def interpret_kwargs(interpret: bool) -> dict[str, Any]:
  """`plgpu.kernel` keyword arguments that run it in Mosaic GPU's CPU
  interpreter when `interpret` is set (none otherwise)."""
  return {"interpret": plgpu.InterpretGPUParams()} if interpret else {}
