"""Where the Mosaic GPU kernels meet jax's own Mosaic GPU machinery, so that a
difference between the supported releases (0.11.2 on the GPU machine, 0.12 in
CI) has one place to go.

Checked on both releases (interpret runs, H100 lowering and the sm_90a
compile of every shipped config): the API these kernels use is the same.
The differences found are behavioural, and handled where they arise: the
0.11.2 interpreter also requires every thread that waited on a barrier to
have observed all of its phases when the barrier is freed (the kernels'
producers drain their last releases), and the 0.11.2 CUDA plugin embeds no
GPU target descriptions (`jaxkern.aot` compiles with the H100/H200 texts
shipped in `jaxkern/aot/gpu_targets/`). Both are tested in the device-stack
lane (the fault tests and the sm_90a compile of the shipped configs on
0.11.2).
"""

from __future__ import annotations

from typing import Any

from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from jax.experimental.pallas import mosaic_gpu as plgpu


def interpret_kwargs(interpret: bool) -> dict[str, Any]:
  """`plgpu.kernel` keyword arguments that run it in Mosaic GPU's CPU
  interpreter when `interpret` is set (none otherwise)."""
  return {"interpret": plgpu.InterpretGPUParams()} if interpret else {}


def reset_interpreter() -> None:
  """Clears the interpreter's global state after a kernel failed in it (it
  refuses to run another kernel until then); jax exports no public name for
  it (the same private one in 0.11.2 and 0.12)."""
  interpret_pallas_call.reset_gpu_interpret_mode_state()
