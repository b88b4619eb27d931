"""Flash attention with key masks, cached prefixes and segments, and its backward.

`KERNELS`: backend -> `Kernel`, in the default order of `backend="pallas"`
(Triton first until a GPU has measured both); `config.py` holds the
configs, `keys.py` what the backends share about key sources and
visibility, `triton.py` the Triton kernel (`triton_bwd.py` its backward),
`mosaic_gpu.py` the warp-specialized Hopper forward (its backward is
`triton_bwd.py`'s).
"""

from pallas_kernels.flash_attention import mosaic_gpu, triton
from pallas_kernels.shared.kernel import Kernel, kernels

KERNELS = kernels(
  Kernel.of(triton, launch=triton.flash_attention, own_vjp=True),
  Kernel.of(mosaic_gpu, launch=mosaic_gpu.flash_attention, own_vjp=True),
)
