"""FP8 x MXFP4 m-grouped GEMM.

`KERNELS`: backend -> `Kernel`, in the default order of `backend="pallas"`
(Triton first until a GPU has measured both); `config.py` holds the
configs, `triton.py` the Triton kernel, `mosaic_gpu.py` the warp-specialized
Hopper kernel.
"""

from pallas_kernels.grouped_gemm import mosaic_gpu, triton
from pallas_kernels.shared.kernel import Kernel, kernels

KERNELS = kernels(
  Kernel.of(triton, launch=triton.grouped_gemm_fp8_fp4),
  Kernel.of(mosaic_gpu, launch=mosaic_gpu.grouped_gemm_fp8_fp4),
)
