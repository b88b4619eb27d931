"""Helpers shared by the kernel families: interpret-mode resolution, the
Triton deprecation filter, the `pallas_call` every kernel launches through
(usable inside `jax.shard_map`), block arithmetic, and operand checks
(deviceless lowering and its parsers: `pallas_kernels.shared.lowering`)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.shared.device import has_gpu
from pallas_kernels.shared.kernel import Unsupported

# jax >= 0.11 warns that the Triton lowering is deprecated in favour of Mosaic
# GPU. We target Triton deliberately (SPEC section 2), so the warning is noise.
_TRITON_DEPRECATION = r".*[Tt]riton.*"


def filter_triton_deprecation() -> None:
  """Silences the expected Triton-lowering DeprecationWarning process-wide."""
  warnings.filterwarnings("ignore", message=_TRITON_DEPRECATION, category=DeprecationWarning)


filter_triton_deprecation()


def resolve_interpret(interpret: bool | None) -> bool:
  """`None` means: interpret when no GPU is present."""
  return (not has_gpu()) if interpret is None else bool(interpret)


def varying_axes(*values: Any) -> frozenset[str]:
  """The manual mesh axes (inside `jax.shard_map` with `check_vma=True`) that
  any of the arrays `values` varies over; empty outside a shard_map."""
  axes: frozenset[str] = frozenset()
  for value in jax.tree.leaves(values):
    axes |= frozenset(jax.typeof(value).manual_axis_type.varying)
  return axes


def _varying_struct(shape: jax.ShapeDtypeStruct, axes: frozenset[str]) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape.shape, shape.dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=axes))


def pallas_call(
  kernel: Callable[..., None], *, out_shape: Any, interpret: bool = False, **kwargs: Any
) -> Callable[..., Any]:
  """`pl.pallas_call(kernel, out_shape=..., interpret=..., **kwargs)` that also
  works inside `jax.shard_map` with its default `check_vma=True`: every kernel
  launches through it.

  A kernel computes each output block from its operands alone, so an output
  varies over exactly the manual mesh axes its operands vary over: the call
  declares that on `out_shape` (`manual_axis_type`). The Triton lowering only
  needs that declaration. Interpret mode evaluates the kernel's jaxpr with
  XLA ops and a `while_loop` that JAX types without those axes, so there the
  varying operands are first gathered to values every device holds
  (`all_gather(..., to="invarying")`), the kernel runs once per shard of the
  varying axes (`lax.map`) and each device keeps its own shard's outputs:
  correct and typed, at n times the work, which only CPU checks pay."""

  def call(*args: Any) -> Any:
    axes = varying_axes(*args)
    if not (interpret and axes):
      shapes = jax.tree.map(lambda s: _varying_struct(s, axes), out_shape)
      return pl.pallas_call(kernel, out_shape=shapes, interpret=interpret, **kwargs)(*args)
    mesh_axes = tuple(a for a in jax.sharding.get_abstract_mesh().axis_names if a in axes)
    launch = pl.pallas_call(
      kernel, out_shape=jax.tree.map(lambda s: _varying_struct(s, frozenset()), out_shape), interpret=True, **kwargs
    )
    varying = [i for i, a in enumerate(args) if varying_axes(a)]

    def every_shard(a):  # varying over all of `mesh_axes`, then [shards, ...] on every device
      missing = tuple(ax for ax in mesh_axes if ax not in varying_axes(a))
      return jax.lax.all_gather(
        jax.lax.pcast(a, missing, to="varying") if missing else a, mesh_axes, axis=0, tiled=False, to="invarying"
      )

    def one_shard(shard_args):
      full = list(args)
      for i, a in zip(varying, shard_args):
        full[i] = a
      return launch(*full)

    outs = jax.lax.map(one_shard, [every_shard(args[i]) for i in varying])
    own = jax.lax.axis_index(mesh_axes)
    return jax.tree.map(lambda o: o[own], outs)

  return call


def named_pallas_call(
  kernel: Callable[..., None],
  *,
  inputs: Mapping[str, tuple[Any, Any]],
  outputs: Mapping[str, tuple[Any, Any]],
  **kwargs: Any,
) -> dict[str, Any]:
  """`pallas_call` with operands by name, for kernels with optional ones.

  `inputs`: name -> (array or None, BlockSpec); `outputs`: name ->
  (`jax.ShapeDtypeStruct` or None, BlockSpec). Absent (None) operands are
  not launched; `kernel` receives every name as a keyword argument: the ref
  of each present operand (inputs and outputs alike, refs named `<name>_ref`)
  and None for each absent one. Returns the present outputs by name; the
  other keyword arguments go to `pallas_call`."""
  given = [n for n, (x, _) in inputs.items() if x is not None]
  made = [n for n, (shape, _) in outputs.items() if shape is not None]
  clash = set(inputs) & set(outputs)
  if clash:
    raise ValueError(f"operands named both as input and output: {sorted(clash)}")
  absent = {f"{n}_ref": None for n in (*inputs, *outputs) if n not in given and n not in made}

  def body(*refs):
    kernel(**{f"{n}_ref": r for n, r in zip([*given, *made], refs)}, **absent)

  outs = pallas_call(
    body,
    out_shape=[outputs[n][0] for n in made],
    in_specs=[inputs[n][1] for n in given],
    out_specs=[outputs[n][1] for n in made],
    **kwargs,
  )(*[inputs[n][0] for n in given])
  return dict(zip(made, outs))


def compiler_params(stage: Any) -> plgpu.CompilerParams:
  """The Triton launch parameters of a config (or a stage of one) with
  `num_warps` and `num_stages` fields."""
  return plgpu.CompilerParams(num_warps=stage.num_warps, num_stages=stage.num_stages)


def cdiv[T: (int, jax.Array)](a: T, b: int) -> T:
  """`a / b` rounded up, for `a >= 0`: an int, or an int array in a kernel."""
  return -(-a // b)


def next_pow2(n: int) -> int:
  """Smallest power of two >= n (and >= 1)."""
  return 1 << max(int(n) - 1, 0).bit_length()


# `jnp.dot` on the Triton lowering needs every dot dimension >= 16.
MIN_DOT_DIM = 16

# `lax.dot_general` dimension numbers of an NT product `x [rows, K] . y [cols, K]`:
# contract the last axis of both, no batch axes (x @ y.T without a transpose).
NT_DIMS = (((1,), (1,)), ((), ()))


def is_pow2(n: int) -> bool:
  return n >= 1 and not n & (n - 1)


def check_pow2_dim(name: str, value: int, minimum: int = MIN_DOT_DIM) -> None:
  """Raises `Unsupported` (a ValueError: the kernel's limit, not the op's
  contract, so the dispatch names the backend or falls back) unless an
  input dimension is a power of two >= minimum (a head dim that becomes a
  dot dimension, by default)."""
  if value < minimum or not is_pow2(value):
    raise Unsupported(f"{name}={value} must be a power of two >= {minimum}")


def fitted_candidates(chosen: Any, sweep: Iterable[Any], fit: Callable[[Any], Any]) -> list[Any]:
  """A sweep's candidates: the heuristic's `chosen` first, then each config
  of `sweep` fitted to the problem, without duplicates."""
  return list(dict.fromkeys([chosen, *(fit(c) for c in sweep)]))


def fit_block(block: int, size: int) -> int:
  """Shrinks `block` to the smallest power of two covering `size` (>= 16)."""
  return max(MIN_DOT_DIM, min(block, next_pow2(size)))


def check_nt_operands(x, w, x_name: str, w_name: str) -> None:
  """Raises unless x [rows, K] and w [cols, K] are 2-D, share K and a dtype
  (the operand pair of an NT matmul)."""
  if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
    raise ValueError(f"expected {x_name} [rows, K] and {w_name} [cols, K], got {x.shape} and {w.shape}")
  if x.dtype != w.dtype:
    raise ValueError(f"{x_name} and {w_name} must share a dtype, got {x.dtype} and {w.dtype}")
