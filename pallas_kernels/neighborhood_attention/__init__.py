"""3-D neighborhood attention (NATTEN windows) and its backward.

`KERNELS`: backend -> `Kernel`, in the default order of `backend="pallas"`;
`config.py` holds the configs, `triton.py` the Triton kernel (`triton_bwd.py` its backward).
"""

from pallas_kernels.neighborhood_attention import triton
from pallas_kernels.shared.kernel import Kernel, kernels

KERNELS = kernels(
  Kernel.of(triton, launch=triton.neighborhood_attention_3d, own_vjp=True),
)
