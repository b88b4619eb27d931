"""Gated delta net decode step.

`KERNELS`: backend -> `Kernel`, in the default order of `backend="pallas"`;
`config.py` holds the configs, `triton.py` the Triton kernel.
"""

from pallas_kernels.gdn_decode import triton
from pallas_kernels.shared.kernel import Kernel, kernels

KERNELS = kernels(
  Kernel.of(triton, launch=triton.gdn_decode),
)
