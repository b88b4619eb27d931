"""Set-up shared by every test process (each pytest-xdist worker)."""

import os

import pytest

from jaxkern.aot.toolchain import skip_cuda_checks

# With the aot extra installed (`make test` puts .aot-toolchain/ on the path),
# the CUDA plugin registers only if its runtime checks are skipped before the
# process first initializes JAX's backends (importing jaxkern skips them only
# on a host without NVIDIA devices); the sm_90a compile tests (tests/test_aot.py)
# need it registered whichever test a worker runs first, and on a host
# without CUDA the skipped check logs no cuDNN traceback. Devices stay the
# CPU's. Without the extra this changes nothing.
skip_cuda_checks()

# Every Mosaic GPU kernel run in interpret mode here runs the interpreter's
# race detector (`mosaic_gpu_compat.kernel`): a race fails the call with
# `RaceDetected` naming the kernel. Set here, before any kernel is traced;
# subprocesses inherit it. JAXKERN_DETECT_RACES=0 turns it off.
os.environ.setdefault("JAXKERN_DETECT_RACES", "1")


def pytest_collection_modifyitems(config, items):
  """Slow tests first; tests marked `lane_only` run in the device-stack lane (`make
  test-device`, where JAXKERN_DEVICE_STACK=1): the GPU machine's jax is the
  one they check, and running them in both environments would double their
  cost in `make test`."""
  # The subprocess tests (`slow`, up to minutes each) go first: scheduled
  # last, one of them would run alone on one worker at the end.
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)
  if os.environ.get("JAXKERN_DEVICE_STACK") == "1":
    return
  skip = pytest.mark.skip(reason="runs in the device-stack lane (make test-device)")
  for item in items:
    if item.get_closest_marker("lane_only"):
      item.add_marker(skip)
