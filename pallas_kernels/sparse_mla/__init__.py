"""Sparse MLA prefill over gathered latent rows.

`KERNELS`: backend -> `Kernel`, in the default order of `backend="pallas"`;
`config.py` holds the configs, `triton.py` the Triton kernel.
"""

from pallas_kernels.sparse_mla import triton
from pallas_kernels.shared.kernel import Kernel, kernels

KERNELS = kernels(
    Kernel.of(triton, launch=triton.sparse_mla_prefill),
)
