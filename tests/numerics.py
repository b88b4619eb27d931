"""Assertions shared by the family tests (not a test file)."""

import numpy as np


def assert_bf16_close(actual, desired):
  """SPEC 5 bf16 rule: an element fails where |x-y| > 0.005 and |x-y| > 0.016*|y|;
  any non-finite output fails (an unmasked edge reads NaN in interpret mode)."""
  x = np.asarray(actual, np.float32)
  y = np.asarray(desired, np.float32)
  assert x.shape == y.shape, (x.shape, y.shape)
  assert np.all(np.isfinite(x)), "non-finite kernel output"
  err = np.abs(x - y)
  bad = (err > 0.005) & (err > 0.016 * np.abs(y))
  assert not bad.any(), f"{bad.sum()} elements off, max abs err {err.max()}"
