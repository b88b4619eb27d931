"""FP8 x MXFP4 m-grouped GEMM.

`KERNELS`: backend -> `Kernel`, in the default order of `backend="pallas"`;
`config.py` holds the configs, `triton.py` the Triton kernel.
"""

from pallas_kernels.grouped_gemm import triton
from pallas_kernels.shared.kernel import Kernel, kernels

KERNELS = kernels(
  Kernel.of(triton, launch=triton.grouped_gemm_fp8_fp4),
)
