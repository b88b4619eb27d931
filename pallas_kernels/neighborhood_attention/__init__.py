"""3-D neighborhood attention (NATTEN windows) and its backward.

`KERNELS`: backend -> `Kernel`, in the default order of `backend="pallas"`
(Triton first until a GPU has measured both); `config.py` holds the
configs, `tiles.py` the Triton kernels' tile and slot logic, `triton.py` the
Triton kernel (`triton_bwd.py` its backward), `mosaic_gpu.py` the
warp-specialized Hopper forward (`boxes.py` its box geometry; its backward
is `triton_bwd.py`'s).
"""

from pallas_kernels.neighborhood_attention import mosaic_gpu, triton
from pallas_kernels.shared.kernel import Kernel, kernels

KERNELS = kernels(
  Kernel.of(triton, launch=triton.neighborhood_attention_3d, own_vjp=True),
  Kernel.of(mosaic_gpu, launch=mosaic_gpu.neighborhood_attention_3d, own_vjp=True),
)
