"""Mixed FP8/FP4 MLA decode over paged byte caches.

`KERNELS`: backend -> `Kernel`, in the default order of `backend="pallas"`;
`config.py` holds the configs, `triton.py` the Triton kernel.
"""

from pallas_kernels.mixed_mla import triton
from pallas_kernels.shared.kernel import Kernel, kernels

KERNELS = kernels(
    Kernel.of(triton, launch=triton.mixed_mla_decode),
)
