"""Assertions shared by the family tests (not a test file): SPEC 5 through
`jaxkern.compare`, so that tests and replay apply one tolerance rule."""

import numpy as np

from jaxkern import compare


def assert_close(actual, desired, dtype: str = "bfloat16") -> None:
  """SPEC 5 rule of `dtype` ("bfloat16" or "float32", `compare`'s
  tolerances): an element fails where |x-y| > atol and |x-y| > rtol*|y|; a
  non-finite output where the reference is finite fails (an unmasked edge
  reads NaN in interpret mode); equal non-finite values (+inf lse) match."""
  x, y = np.asarray(actual), np.asarray(desired)
  assert x.shape == y.shape, (x.shape, y.shape)
  tol = compare.DEFAULT_TOLERANCES[dtype]
  result = compare.compare_float("output", x, y, tol["atol"], tol["rtol"])
  assert result.status == compare.PASSED, f"{result.message}; max abs err {result.max_abs_error}"


def assert_bf16_close(actual, desired) -> None:
  assert_close(actual, desired, "bfloat16")


def assert_f32_close(actual, desired) -> None:
  assert_close(actual, desired, "float32")
