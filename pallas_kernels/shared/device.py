"""Facts about the GPU the heuristics size their grids for.

The heuristics aim for a number of programs per SM, so they need the SM count:
read from the GPU where one is present (`core_count` of the first GPU device:
132 on an H100 SXM or an H200, 114 on an H100 PCIe), else `DEFAULT_NUM_SMS`.
Without a GPU (tests, interpret mode, deviceless compiles) the default applies,
so every heuristic stays deterministic there.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels.shared.common import has_gpu

# SMs of an H100 SXM and of an H200, the GPUs the kernels are tuned for.
DEFAULT_NUM_SMS = 132
# Shared memory one CTA may use on an H100/H200 (227 KiB, the opt-in maximum);
# jax exposes no device attribute for it.
SHARED_MEMORY_PER_BLOCK = 232448


@functools.cache
def num_sms() -> int:
  """The SM count of the first GPU, or `DEFAULT_NUM_SMS` without one (or when
  the device does not report it)."""
  if not has_gpu():
    return DEFAULT_NUM_SMS
  count = getattr(jax.devices("gpu")[0], "core_count", None)
  return int(count) if isinstance(count, int) and count > 0 else DEFAULT_NUM_SMS
