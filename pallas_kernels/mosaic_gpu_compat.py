"""The one place where Mosaic GPU's API differs between the jax releases the
project supports (0.11.2 on the GPU machine, 0.12 in CI)."""

from __future__ import annotations

from typing import Any

from jax.experimental.pallas import mosaic_gpu as plgpu
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call


def interpret_kwargs(interpret: bool) -> dict[str, Any]:
  """`plgpu.kernel` keyword arguments that run it in Mosaic GPU's CPU
  interpreter when `interpret` is set (none otherwise)."""
  return {"interpret": plgpu.InterpretGPUParams()} if interpret else {}


def reset_interpreter() -> None:
  """Clears the interpreter's global state after a kernel failed in it (it
  refuses to run another kernel until then); jax exports no public name."""
  interpret_pallas_call.reset_gpu_interpret_mode_state()
