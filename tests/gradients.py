"""Gradient checks shared by the family tests (not a test file): gradients of
an op on both paths under jit, the Pallas calls of a gradient's jaxpr, and
central finite differences in float64.

`loss` weighs the op's (first) output with fixed random weights, so every
element's cotangent differs and a gradient routed to the wrong row, key or
head cannot cancel out."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from jaxkern import compare


def weights_like(shape, seed: int = 99) -> jax.Array:
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


def loss(fn: Callable[..., Any], weights: jax.Array) -> Callable[..., jax.Array]:
  """`sum(fn(*args) * weights)` in fp32 (the first output of a tuple)."""

  def f(*args):
    out = fn(*args)
    out = out[0] if isinstance(out, tuple) else out
    return jnp.sum(out.astype(jnp.float32) * weights)

  return f


def grads(fn: Callable[..., Any], args: Sequence[Any], argnums: Sequence[int], seed: int = 99) -> tuple:
  """`jax.jit(jax.grad(loss))` of `fn` at `args` with respect to `argnums`."""
  out = jax.eval_shape(fn, *args)
  weights = weights_like((out[0] if isinstance(out, tuple) else out).shape, seed)
  return jax.jit(jax.grad(loss(fn, weights), argnums=tuple(argnums)))(*args)


def assert_grads_close(actual: Sequence[Any], desired: Sequence[Any], names: Sequence[str] = ()) -> None:
  """Gradients of a bf16 op on the Pallas path against the XLA path's:
  each element within bf16's rtol (`jaxkern.compare`) of the XLA value or
  within 1% of the largest XLA gradient of that input. The absolute term
  is what a flash backward's bf16 rounding of the probabilities and their
  gradients (before fp32-accumulated dots) leaves on sums that cancel; a
  gradient routed to a wrong element is off by O(its largest value)."""
  rtol = compare.DEFAULT_TOLERANCES["bfloat16"]["rtol"]
  for i, (x, y) in enumerate(zip(actual, desired)):
    name = names[i] if i < len(names) else i
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    assert x.shape == y.shape, (name, x.shape, y.shape)
    assert np.all(np.isfinite(x)), (name, "non-finite gradient")
    scale = np.abs(y).max() if y.size else 0.0
    err = np.abs(x - y)
    bad = err > rtol * np.abs(y) + 0.01 * scale
    assert not bad.any(), (name, f"{bad.sum()} of {bad.size} elements off; max err {err.max()} at scale {scale}")


def pallas_calls(fn: Callable[..., Any], *args) -> list[str]:
  """Names of the `pallas_call`s in the jaxpr of `fn(*args)` (nested
  jaxprs included)."""
  names = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        names.append(str(eqn.params["name"]))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jax.make_jaxpr(fn)(*args))
  return names


def finite_difference_grads(
  fn64: Callable[..., Any], args: Sequence[np.ndarray], weights: np.ndarray, eps: float = 1e-5
) -> list[np.ndarray]:
  """Central differences of `sum(fn64(*args) * weights)` with respect to
  every arg, in float64 (`fn64` maps float64 numpy arrays to one)."""

  def f(*a):
    return float(np.sum(np.asarray(fn64(*a), np.float64) * weights))

  out = []
  for i, x in enumerate(args):
    g = np.zeros_like(x, np.float64)
    for idx in np.ndindex(*x.shape):
      plus, minus = [a.copy() for a in args], [a.copy() for a in args]
      plus[i][idx] += eps
      minus[i][idx] -= eps
      g[idx] = (f(*plus) - f(*minus)) / (2 * eps)
    out.append(g)
  return out
