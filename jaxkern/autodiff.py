"""How `jax.grad` (and `jax.jvp` on the XLA path) goes through a public op:
one mechanism for every family, applied by `jaxkern.dispatch.run`.

* A family whose kernel is a `jax.custom_vjp` with Pallas backward kernels
  says so (`Kernel.own_vjp`); its kernel is called as is.
* Any other kernel is wrapped in a `jax.custom_vjp` whose backward pass is
  the VJP of the family's reference at the same inputs (recomputed in the
  backward pass, so only the inputs are kept): the Pallas path then has the
  XLA path's gradient instead of a bare assertion from inside `pallas_call`.
* The reference (the XLA path) is wrapped in a `jax.custom_jvp` that applies
  the same rules and is otherwise plain JAX autodiff (forward and reverse).

The rules, the same on both paths: a gradient flows to every floating input
of 16 bits or more; integer and bool inputs (indices, masks, lengths) have
none (JAX's float0); differentiating with respect to a quantized input (a
float type of 8 bits or fewer, e.g. FP8 activations) raises
`NotDifferentiableError`, which names the op, the input and why, as does a
reference whose own differentiation fails.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero, zero_from_primal


class NotDifferentiableError(TypeError):
  """A gradient was asked of an op (or an input of it) that has none."""


def op_name(reference: Callable[..., Any]) -> str:
  """The op's name in messages: its reference function's (constant axes
  bound or not), without `_reference`."""
  while isinstance(reference, functools.partial):
    reference = reference.func
  return reference.__name__.removesuffix("_reference")


def split_arrays(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
  """(arrays, statics): arrays are what autodiff may perturb (jax and numpy
  arrays, tracers); everything else (None, Python numbers, dtypes) is a
  static argument of both paths."""
  arrays = {k: v for k, v in values.items() if isinstance(v, (jax.Array, np.ndarray))}
  return arrays, {k: v for k, v in values.items() if k not in arrays}


def _is_quantized(dtype) -> bool:
  dtype = jnp.dtype(dtype)
  return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize <= 1


def check_perturbed(name: str, arrays: Mapping[str, Any], perturbed: Mapping[str, bool]) -> None:
  """Raises `NotDifferentiableError` if a perturbed input is quantized."""
  for key, value in arrays.items():
    if perturbed.get(key) and _is_quantized(value.dtype):
      raise NotDifferentiableError(
        f"{name} is not differentiable with respect to {key!r} ({jnp.dtype(value.dtype).name}): it is a "
        "quantized input, and rounding to it has no useful gradient; differentiate the unquantized "
        "computation instead (for the FP8 x FP4 grouped GEMM: jaxkern.ops.grouped_gemm_mxfp4_ste, a "
        "straight-through estimator)"
      )


def _materialize(tangent: Any, like: Any) -> Any:
  """A symbolic zero as an array (float0 for integer inputs and outputs)."""
  return zero_from_primal(like) if isinstance(tangent, SymbolicZero) else tangent


def _reference_failed(name: str, error: Exception) -> NotDifferentiableError:
  return NotDifferentiableError(
    f"{name} is not differentiable here: differentiating its reference failed with {type(error).__name__}: {error}"
  )


def xla_path(reference: Callable[..., Any], arrays: dict[str, Any], statics: dict[str, Any]) -> Any:
  """`reference(**arrays, **statics)` with plain autodiff under the rules."""
  name = op_name(reference)

  def call(x):
    return reference(**x, **statics)

  f = jax.custom_jvp(call)

  def jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    check_perturbed(name, x, {k: not isinstance(v, SymbolicZero) for k, v in t.items()})
    t = {k: _materialize(v, x[k]) for k, v in t.items()}
    try:
      return jax.jvp(call, (x,), (t,))
    except Exception as e:
      raise _reference_failed(name, e) from e

  f.defjvp(jvp, symbolic_zeros=True)
  return f(arrays)


def pallas_path(
  kernel: Callable[..., Any], reference: Callable[..., Any], arrays: dict[str, Any], statics: dict[str, Any]
) -> Any:
  """`kernel(**arrays, **statics)`, differentiated through `reference`."""
  name = op_name(reference)

  def call_reference(x):
    return reference(**x, **statics)

  f = jax.custom_vjp(lambda x: kernel(**x, **statics))

  def fwd(x):
    check_perturbed(name, {k: p.value for k, p in x.items()}, {k: p.perturbed for k, p in x.items()})
    x = {k: p.value for k, p in x.items()}
    return kernel(**x, **statics), x

  def bwd(x, cotangents):
    try:
      out, vjp = jax.vjp(call_reference, x)
      cotangents = jax.tree.map(_materialize, cotangents, out, is_leaf=lambda c: isinstance(c, SymbolicZero))
      return vjp(cotangents)
    except Exception as e:
      raise _reference_failed(name, e) from e

  f.defvjp(fwd, bwd, symbolic_zeros=True)
  return f(arrays)
