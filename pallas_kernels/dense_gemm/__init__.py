"""Dense NT GEMM C = A @ B^T and its gradients.

`KERNELS`: backend -> `Kernel`, in the default order of `backend="pallas"`;
`config.py` holds the configs, `triton.py` the Triton kernel.
"""

from pallas_kernels.dense_gemm import triton
from pallas_kernels.shared.kernel import Kernel, kernels

KERNELS = kernels(
    Kernel.of(triton, launch=triton.dense_gemm_nt, own_vjp=True),
)
