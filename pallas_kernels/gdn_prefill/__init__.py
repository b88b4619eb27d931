"""Gated delta net chunk-parallel prefill and its backward.

`KERNELS`: backend -> `Kernel`, in the default order of `backend="pallas"`;
`config.py` holds the configs, `triton.py` the Triton kernel (`triton_bwd.py` its backward).
"""

from pallas_kernels.gdn_prefill import triton
from pallas_kernels.shared.kernel import Kernel, kernels

KERNELS = kernels(
  Kernel.of(triton, launch=triton.gdn_prefill, own_vjp=True),
)
