"""What the `jaxkern.nn` layers share: parameters with sharding metadata,
the bf16 projection on `ops.dense_gemm`, and the reshards that keep each op
on a layout it can split (Explicit meshes).

Parameters are float32 master weights (what the optimizer updates), in the
layout the ops take: projections `[out, in]` (torch's Linear layout,
`ops.dense_gemm`'s b), experts `[E, out, in]`. The layers cast them to bf16
(the kernels' dtype) on every call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkern import ops

Axis = str | None  # a mesh axis name, or None: not split

# N(0, 1/fan_in) for weights laid out [..., out, in] (flax's Linear is [in, out]).
LECUN_OUT_IN = nnx.initializers.lecun_normal(in_axis=-1, out_axis=-2)
LECUN_EXPERTS = nnx.initializers.lecun_normal(in_axis=-1, out_axis=-2, batch_axis=(0,))


def param(
  rngs: nnx.Rngs,
  shape: Sequence[int],
  sharding: Sequence[Axis] | None = None,
  *,
  init: Any = LECUN_OUT_IN,
  dtype: Any = jnp.float32,
) -> nnx.Param:
  """An `nnx.Param` of `shape` drawn by `init`, carrying `sharding` (one mesh
  axis or None per dim) as its sharding metadata (`nnx.with_partitioning`)
  unless that is None. Flax places an annotated parameter on the current
  mesh when it is created (its eager sharding, on by default), so a layer
  with sharded parameters is created under `jax.set_mesh(mesh)`;
  `nnx.get_partition_spec` reads the specs back."""
  if sharding is not None:
    if len(sharding) != len(shape):
      raise ValueError(f"sharding {tuple(sharding)} does not name the {len(shape)} dims of shape {tuple(shape)}")
    init = nnx.with_partitioning(init, tuple(sharding))
  return nnx.Param(init(rngs.params(), tuple(shape), dtype))


def head_specs(heads_axis: Axis):
  """`spec(*axes)` for a layer's parameters: the axes, or None (no sharding
  metadata) when the layer splits nothing (`heads_axis` None)."""
  return lambda *axes: None if heads_axis is None else axes


def dense(x: jax.Array, w: jax.Array, backend: ops.Backend) -> jax.Array:
  """`x @ w.T` on `ops.dense_gemm`: x [..., in], w [out, in], both cast to
  bf16; returns bf16 [..., out] (fp32 accumulation in the op)."""
  return ops.dense_gemm(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), backend=backend)


def rms_norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """x / rms(x) over the last axis, in fp32, returned in x's dtype."""
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)).astype(x.dtype)


def split_heads(x: jax.Array, heads: int) -> jax.Array:
  """[..., H * D] -> [..., H, D] (head-major features, as the projections lay them out)."""
  return x.reshape(*x.shape[:-1], heads, x.shape[-1] // heads)


def repeat_heads(x: jax.Array, times: int) -> jax.Array:
  """[..., Hkv, D] -> [..., Hkv * times, D], each head repeated `times` times in
  place (head h of the result is head h // times of x: grouped-query
  attention's sharing). A broadcast and a merge of the head dims, so a
  split of Hkv over devices stays a split of the result's heads."""
  if times == 1:
    return x
  *lead, heads, dim = x.shape
  return jnp.broadcast_to(x[..., None, :], (*lead, heads, times, dim)).reshape(*lead, heads * times, dim)


def _explicit_mesh(x: jax.Array):
  mesh = jax.typeof(x).sharding.mesh
  return mesh if not mesh.empty and AxisType.Explicit in mesh.axis_types else None


def _spec(x: jax.Array) -> list[Any]:
  spec = list(jax.typeof(x).sharding.spec)
  return spec + [None] * (x.ndim - len(spec))


def whole(x: jax.Array, *dims: int) -> jax.Array:
  """x with the dims `dims` gathered (not split) on an Explicit mesh, the
  others as they are; x itself elsewhere. Before an op that cannot split
  them (a contraction, tokens a recurrence or a window runs along, rows
  indices address)."""
  mesh = _explicit_mesh(x)
  if mesh is None:
    return x
  spec = _spec(x)
  if all(spec[d] is None for d in dims):
    return x
  for d in dims:
    spec[d] = None
  return jax.sharding.reshard(x, NamedSharding(mesh, P(*spec)))


def split_like(x: jax.Array, spec: Sequence[Axis | None]) -> jax.Array:
  """x resharded to `spec` (one entry per dim) on an Explicit mesh; x itself elsewhere."""
  mesh = _explicit_mesh(x)
  if mesh is None or _spec(x) == list(spec):
    return x
  return jax.sharding.reshard(x, NamedSharding(mesh, P(*spec)))


def sharded_like(x: jax.Array, like: jax.Array) -> jax.Array:
  """x (shaped like `like`) sharded as `like` is, on an Explicit mesh: a
  layer returns its output in its input's layout."""
  if _explicit_mesh(like) is None:
    return x
  return split_like(x, _spec(like))
