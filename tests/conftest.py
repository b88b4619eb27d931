"""Set-up shared by every test process (each pytest-xdist worker)."""

from jaxkern.aot.toolchain import skip_cuda_checks

# With the aot extra installed (`make install` installs it), the CUDA plugin
# registers only if its runtime checks are skipped before the process first
# initializes JAX's backends; the sm_90a compile tests (tests/test_aot.py)
# need it registered whichever test a worker runs first, and on a host
# without CUDA the skipped check logs no cuDNN traceback. Devices stay the
# CPU's. Without the extra this changes nothing.
skip_cuda_checks()
