"""What the Mosaic GPU kernels' synchronization-fault tests share (not a test
file): a launch with a planted fault, and the check that must catch it:
the interpreter's race detector (`mosaic_gpu_compat.kernel`: `RaceDetected`
naming the kernel) or the interpreter's own barrier checks (phases run
ahead of a waiter, arrivals left pending). docs/perf/mosaic_gpu.md ("Race
detector") has which fault each check sees and why."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import pytest

from pallas_kernels.shared import mosaic_gpu_compat as compat


def assert_race_detected(launch: Callable[[], Any], kernel_module: str) -> None:
  """`launch()` (a kernel with a planted race, run with the race detector on)
  fails with `RaceDetected` naming `kernel_module`, after the detector's
  report of the two accesses (`RACE DETECTED`, printed or logged)."""
  try:
    with compat.race_detection(True), pytest.raises(Exception, match=f"RaceDetected: {re.escape(kernel_module)}: "):
      jax.block_until_ready(launch())
  finally:
    compat.reset_interpreter()


def assert_interpreter_reports(launch: Callable[[], Any], match: str) -> None:
  """`launch()` (a kernel with a planted fault) fails in the interpreter's
  own barrier checks with an error matching `match` (with the race
  detector on, as in the suite, these fail the kernel before the
  detector's verdict is read), its state reset afterwards so that later
  kernels can run."""
  try:
    with pytest.raises(Exception, match=match):
      jax.block_until_ready(launch())
  finally:
    compat.reset_interpreter()


def results_without_race_detection(launch: Callable[[], Any]) -> Any:
  """`launch()`'s results with the race detector off: what a fault that only
  the detector sees computes (the interpreter runs a TMA copy when it is
  issued, so data read too early is already there)."""
  with compat.race_detection(False):
    return jax.block_until_ready(launch())
