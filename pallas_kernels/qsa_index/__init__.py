"""QSA index scores and exact top-k.

`KERNELS`: backend -> `Kernel`, in the default order of `backend="pallas"`;
`config.py` holds the configs, `triton.py` the Triton kernel.
"""

from pallas_kernels.qsa_index import triton
from pallas_kernels.shared.kernel import Kernel, kernels

KERNELS = kernels(
  Kernel.of(triton, launch=triton.qsa_index_topk),
)
