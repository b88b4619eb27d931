"""Set-up shared by every test process (each pytest-xdist worker)."""

from jaxkern.aot.toolchain import skip_cuda_checks

# With the optional aot extra installed, the CUDA plugin registers only if its
# runtime checks are skipped before the process first initializes JAX's
# backends; the sm_90a compile tests (tests/test_aot.py) need it registered
# whichever test a worker runs first. Without the extra this changes nothing.
skip_cuda_checks()
