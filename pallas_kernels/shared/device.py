"""Facts about the GPU the heuristics size their grids for.

The heuristics aim for a number of programs per SM, so they need the SM count:
read from the GPU where one is present (`core_count` of the first GPU device;
an H100 PCIe has 114), else `DEFAULT_NUM_SMS`, the H100 SXM's and H200's.
Without a GPU (tests, interpret mode, deviceless compiles) the default applies,
so every heuristic stays deterministic there; the abstract H100 of deviceless
lowering (`pallas_kernels.shared.lowering`) has that many SMs too.
"""

from __future__ import annotations

import functools

import jax

# SMs of an H100 SXM and of an H200, the GPUs the kernels are tuned for: the
# one place this number is written.
DEFAULT_NUM_SMS = 132
# Shared memory one CTA may use on an H100/H200 (227 KiB, the opt-in maximum);
# jax exposes no device attribute for it.
SHARED_MEMORY_PER_BLOCK = 232448


@functools.cache
def has_gpu() -> bool:
  """Whether jax has a GPU device."""
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


@functools.cache
def num_sms() -> int:
  """The SM count of the first GPU, or `DEFAULT_NUM_SMS` without one (or when
  the device does not report it)."""
  if not has_gpu():
    return DEFAULT_NUM_SMS
  count = getattr(jax.devices("gpu")[0], "core_count", None)
  return int(count) if isinstance(count, int) and count > 0 else DEFAULT_NUM_SMS
