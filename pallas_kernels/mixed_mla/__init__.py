"""Mixed FP8/FP4 MLA decode over paged byte caches.

`KERNELS`: backend -> `Kernel`, in the default order of `backend="pallas"`;
`config.py` holds the configs, `caches.py` the cache layouts and input checks
both kernels share, `triton.py` the Triton kernel, `mosaic_gpu.py` the Mosaic
GPU one (64 heads per wgmma tile, a producer warpgroup dequantizing).
"""

from pallas_kernels.mixed_mla import mosaic_gpu, triton
from pallas_kernels.shared.kernel import Kernel, kernels

KERNELS = kernels(
  Kernel.of(triton, launch=triton.mixed_mla_decode),
  Kernel.of(mosaic_gpu, launch=mosaic_gpu.mixed_mla_decode),
)
