"""Dense NT GEMM C = A @ B^T and its gradients.

`KERNELS`: backend -> `Kernel`, in the default order of `backend="pallas"`
(Triton first until a GPU has measured both); `config.py` holds the configs
and what the backends share, `triton.py` the Triton kernel (with its
backward), `mosaic_gpu.py` the warp-specialized Hopper kernel (forward).
"""

from pallas_kernels.dense_gemm import mosaic_gpu, triton
from pallas_kernels.shared.kernel import Kernel, kernels

KERNELS = kernels(
  Kernel.of(triton, launch=triton.dense_gemm_nt, own_vjp=True),
  Kernel.of(mosaic_gpu, launch=mosaic_gpu.dense_gemm_nt),
)
