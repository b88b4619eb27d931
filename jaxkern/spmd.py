"""Ops on sharded arrays: how `jaxkern.dispatch` runs a family's kernel or
reference when its inputs are split across devices.

A family declares on its `OpImpl` how its op splits (`Split`): a name for
each dimension of each input and output (`"m k"`), and the names along which
the op is independent (rows, batch, heads, output columns): one shard of
those needs only the matching shards of the inputs. A name on several
dimensions splits them together (q's and k's heads; sizes may differ, as for
grouped heads, when each divides by the shard count). What the op combines
(a contraction, the experts a top-k picks from, the tokens of a recurrence)
cannot be split.

Three settings (README, "Sharded models"):
* Inside `jax.shard_map`: the op sees one shard and runs as is; its Pallas
  calls declare the manual axes their outputs vary over
  (`pallas_kernels.shared.common.pallas_call`).
* `jit` over arrays sharded on Explicit mesh axes (`jax.make_mesh`'s
  default): shardings are part of the types, so `run` wraps the call in a
  `shard_map` over the axes that shard independent dimensions, reshards the
  other inputs with such a dimension to match (a local slice) and returns
  outputs sharded the same way. A sharded dimension the op cannot split is a
  ValueError naming the input, the dimension and why.
* `jit` over Auto mesh axes (`jax.sharding.Mesh`'s default): the compiler
  picks shardings. The XLA path is jnp that XLA partitions itself. The Pallas
  path is a `custom_partitioning` of the kernel call: its rule tells the
  partitioner which dimensions correspond, and at partition time the
  independent dimensions keep the shardings it proposes (the others are
  gathered) and the kernel runs per shard. Differentiation and `vmap` of
  that call use one unpartitioned call instead (custom_partitioning has no
  rules for them).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule, custom_partitioning
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

Arrays = Mapping[str, jax.Array]
Factors = dict[str, tuple[str, ...]]  # dimension name -> mesh axes splitting it
# Why a contraction dimension cannot be split (the reason most ops give).
CONTRACTION = "the contraction: partial sums would need a reduction across devices"


@dataclasses.dataclass(frozen=True)
class Split:
  """How an op splits across devices.

  `inputs`: input name -> one name per dimension, space separated ("" for a
  scalar); `outputs`: the same per output, in output order; `independent`:
  the dimension names the op may be split along; `reasons`: why another
  name cannot be split (in the error a user sees), by name."""

  inputs: Mapping[str, str]
  outputs: tuple[str, ...]
  independent: str
  reasons: Mapping[str, str] = dataclasses.field(default_factory=dict)

  def dims(self, name: str) -> tuple[str, ...]:
    return tuple(self.inputs[name].split())

  def output_dims(self) -> list[tuple[str, ...]]:
    return [tuple(o.split()) for o in self.outputs]

  def splits(self, factor: str) -> bool:
    return factor in self.independent.split()

  def reason(self, factor: str) -> str:
    return self.reasons.get(factor, "the op combines values along it")


def _axes(entry: Any) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def spec_for(dims: tuple[str, ...], factors: Factors) -> P:
  """The PartitionSpec of an array with dimension names `dims`."""
  entries = []
  for dim in dims:
    axes = factors.get(dim, ())
    entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return P(*entries)


def check_ranks(split: Split, op: str, arrays: Arrays) -> None:
  for name, x in arrays.items():
    if name not in split.inputs or len(split.dims(name)) != x.ndim:
      raise ValueError(
        f"{op}: the split rule names dims {split.inputs.get(name)!r} for input {name!r}, which has shape {x.shape}"
      )


def assign(
  split: Split,
  op: str,
  specs: Mapping[str, Any],
  shapes: Mapping[str, tuple[int, ...]],
  axis_sizes: Mapping[str, int],
  *,
  strict: bool,
) -> Factors:
  """The mesh axes of each split dimension, read from the inputs' specs.

  A sharding the op cannot follow (a dimension it combines, two inputs
  disagreeing, an axis splitting two dimensions, a size the shard count does
  not divide) raises a ValueError with `strict`, else is dropped (that input
  gets gathered along it)."""
  factors: Factors = {}
  for name, spec in specs.items():
    dims = split.dims(name)
    for i, entry in enumerate(spec or ()):
      axes = _axes(entry)
      if not axes:
        continue
      dim = dims[i]
      where = f"input {name!r} {tuple(shapes[name])} is sharded over mesh axes {axes} along dim {i} ({dim!r})"
      taken = {a for d, used in factors.items() if d != dim for a in used}
      count = math.prod(axis_sizes[a] for a in axes)
      uneven = [
        (other, j, size)
        for other in specs
        for j, (d, size) in enumerate(zip(split.dims(other), shapes[other]))
        if d == dim and size % count
      ]
      if not split.splits(dim):
        problem = (
          f"{where}, which it cannot be split along: {split.reason(dim)}. Replicate that dim "
          f"(jax.sharding.reshard) or split another"
        )
      elif dim in factors and factors[dim] != axes:
        problem = f"{where}, but another input shards {dim!r} over {factors[dim]}: shard them alike"
      elif taken & set(axes):
        problem = f"{where}, but those axes already split another dim"
      elif uneven:
        problem = f"{where}: {count} shards do not divide input {uneven[0][0]!r} dim {uneven[0][1]} ({uneven[0][2]})"
      else:
        factors[dim] = axes
        continue
      if strict:
        raise ValueError(f"{op}: {problem}")
  return factors


def _mesh(arrays: Arrays):
  """The (abstract) mesh the arrays' types carry, or None."""
  for x in arrays.values():
    mesh = jax.typeof(x).sharding.mesh
    if not mesh.empty:
      return mesh
  return None


def _as_outputs(out: Any, count: int) -> Any:
  """The call's result as one array or a tuple (so out_specs match)."""
  return out if count == 1 else tuple(out)


def run(
  split: Split | None, op: str, call: Callable[[Arrays], Any], arrays: Arrays, *, pallas: bool, check_vma: bool = True
) -> Any:
  """`call(arrays)` (one op call on whole or per-shard inputs) on the
  arrays as they are sharded; see the module docstring."""
  mesh = _mesh(arrays)
  if mesh is None:
    # No mesh in the types: one device, or shardings only the compiler knows
    # (jit's in_shardings over a classic mesh); the partitioned call lowers
    # as a plain one where the program turns out to be on one device.
    context = jax.sharding.get_abstract_mesh()
    if pallas and split is not None and jax.device_count() > 1 and AxisType.Manual not in context.axis_types:
      return _run_partitioned(split, op, call, arrays)
    return call(arrays)
  specs = {n: jax.typeof(x).sharding.spec for n, x in arrays.items()}
  if any(_axes(e) for spec in specs.values() for e in spec):
    if split is None:
      raise ValueError(f"{op} cannot run on sharded inputs: its family declares no split")
    return _run_explicit(split, op, call, arrays, specs, mesh, check_vma=check_vma)
  auto = [s for s, t in zip(mesh.axis_sizes, mesh.axis_types) if t == AxisType.Auto]
  if pallas and split is not None and math.prod(auto) > 1 and AxisType.Manual not in mesh.axis_types:
    return _run_partitioned(split, op, call, arrays)
  return call(arrays)


def _run_explicit(split: Split, op: str, call, arrays: Arrays, specs, mesh, *, check_vma: bool) -> Any:
  check_ranks(split, op, arrays)
  shapes = {n: x.shape for n, x in arrays.items()}
  factors = assign(split, op, specs, shapes, dict(zip(mesh.axis_names, mesh.axis_sizes)), strict=True)
  in_specs = {n: spec_for(split.dims(n), factors) for n in arrays}
  # Inputs not yet sharded along a split dim get their shard (a local slice).
  arrays = {
    n: x if specs[n] == in_specs[n] else jax.sharding.reshard(x, NamedSharding(mesh, in_specs[n]))
    for n, x in arrays.items()
  }
  out_specs = tuple(spec_for(dims, factors) for dims in split.output_dims())
  count = len(out_specs)
  # Manual over every mesh axis (those splitting nothing replicate): the
  # interpreted kernels cannot run with Explicit axes left.
  return jax.shard_map(
    lambda a: _as_outputs(call(a), count),
    mesh=mesh,
    in_specs=(in_specs,),
    out_specs=out_specs[0] if count == 1 else out_specs,
    check_vma=check_vma,
  )(arrays)


def sharding_rule(
  split: Split, names: list[str], shapes: Mapping[str, tuple[int, ...]], out_shapes: list[tuple[int, ...]]
) -> SdyShardingRule:
  """The Shardy rule of a call: one factor per dimension name and size (a
  factor has one size; grouped heads get two, kept together at partition
  time), the dimensions the op combines marked as needing replication."""

  def factor(dim: str, size: int) -> str:
    return f"{dim}_{size}"

  operands = [ArrayMapping(*(factor(d, s) for d, s in zip(split.dims(n), shapes[n]))) for n in names]
  results = [
    ArrayMapping(*(factor(d, s) for d, s in zip(dims, shape))) for dims, shape in zip(split.output_dims(), out_shapes)
  ]
  # In order of first use: Shardy wants special factors sorted by index.
  combined = dict.fromkeys(f for mapping in operands for f in mapping if not split.splits(f.rsplit("_", 1)[0]))
  return SdyShardingRule(tuple(operands), tuple(results), need_replication_factors=tuple(combined))


def _run_partitioned(split: Split, op: str, call, arrays: Arrays) -> Any:
  check_ranks(split, op, arrays)
  names = list(arrays)
  count = len(split.outputs)

  def plain(*xs):
    return _as_outputs(call(dict(zip(names, xs))), count)

  def shardings(mesh, arg_shapes):
    specs = {n: getattr(s.sharding, "spec", None) for n, s in zip(names, arg_shapes)}
    shapes = {n: s.shape for n, s in zip(names, arg_shapes)}
    factors = assign(split, op, specs, shapes, dict(mesh.shape), strict=False)
    args = tuple(NamedSharding(mesh, spec_for(split.dims(n), factors)) for n in names)
    outs = tuple(NamedSharding(mesh, spec_for(dims, factors)) for dims in split.output_dims())
    return args, outs[0] if count == 1 else outs

  def partition(mesh, arg_shapes, result_shape):
    args, outs = shardings(mesh, arg_shapes)
    return mesh, plain, outs, args

  out_shapes = [o.shape for o in jax.tree.leaves(jax.eval_shape(plain, *arrays.values()))]
  partitioned = custom_partitioning(plain)
  partitioned.def_partition(
    partition,
    infer_sharding_from_operands=lambda mesh, arg_shapes, _: shardings(mesh, arg_shapes)[1],
    sharding_rule=sharding_rule(split, names, {n: x.shape for n, x in arrays.items()}, out_shapes),
  )
  return _untransformed(partitioned, plain)(*arrays.values())


def _untransformed(partitioned: Callable[..., Any], plain: Callable[..., Any]) -> Callable[..., Any]:
  """`partitioned` where it can run; under `vmap` or differentiation, which
  custom_partitioning has no rules for, `plain` (the same function, one
  unpartitioned call)."""

  @jax.custom_batching.custom_vmap
  def batchable(*xs):
    return partitioned(*xs)

  @batchable.def_vmap
  def _(axis_size, in_batched, *xs):
    del axis_size
    out = jax.vmap(plain, in_axes=[0 if b else None for b in in_batched])(*xs)
    return out, jax.tree.map(lambda _: True, out)

  @jax.custom_vjp
  def differentiable(*xs):
    return batchable(*xs)

  def fwd(*xs):
    return jax.vjp(plain, *xs)

  differentiable.defvjp(fwd, lambda vjp, g: vjp(g))
  return differentiable
