"""Sparse MLA prefill over gathered latent rows.

`KERNELS`: backend -> `Kernel`, in the default order of `backend="pallas"`
(Triton first until a GPU has measured both); `config.py` holds the
configs, `slots.py` what the backends share (sizes, input checks, the slot
block table), `triton.py` the Triton kernel, `mosaic_gpu.py` the
warp-specialized Hopper kernel (a producer warpgroup gathering rows).
"""

from pallas_kernels.shared.kernel import Kernel, kernels
from pallas_kernels.sparse_mla import mosaic_gpu, triton

KERNELS = kernels(
  Kernel.of(triton, launch=triton.sparse_mla_prefill),
  Kernel.of(mosaic_gpu, launch=mosaic_gpu.sparse_mla_prefill),
)
