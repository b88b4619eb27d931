"""3-D neighborhood attention (NATTEN) on `ops.neighborhood_attention_3d`."""

from __future__ import annotations

import jax
from flax import nnx

from jaxkern import ops
from jaxkern.nn.common import Axis, dense, head_specs, param, sharded_like, split_heads, split_like, whole


class NeighborhoodAttention3D(nnx.Module):
  """Each token of a [T, Y, X] grid (video frames, rows, columns) attends to
  the `kernel_size` window (KT, KY, KX, or one int for all; each odd in
  NATTEN and at most its extent) around it, shifted inward at the borders:
  q, k, v projections (`ops.dense_gemm`), `ops.neighborhood_attention_3d`
  (q scaled by head_dim**-0.5 first: NATTEN applies no scale), an output
  projection.

  `x` [B, T, Y, X, d_model] (any float dtype) -> [B, T, Y, X, d_model] in
  x's dtype. Parameters (float32, [out, in], LeCun normal): `w_q`, `w_k`,
  `w_v` [H * D, d_model], `w_o` [d_model, H * D].

  `backend` goes to every op call. `heads_axis`: the mesh axis the heads
  are split over (q, k, v projections' output features; the output
  projection replicated). The batch splits as x is split; the grid never
  (windows cross any split: gathered before the op). The output has x's
  sharding.
  """

  def __init__(
    self,
    d_model: int,
    num_heads: int,
    kernel_size: int | tuple[int, int, int],
    *,
    head_dim: int | None = None,
    backend: ops.Backend = None,
    heads_axis: Axis = None,
    rngs: nnx.Rngs,
  ):
    head_dim = d_model // num_heads if head_dim is None else head_dim
    self.num_heads, self.head_dim, self.kernel_size = num_heads, head_dim, kernel_size
    self.backend: ops.Backend = backend
    self.heads_axis = heads_axis
    spec = head_specs(heads_axis)
    self.w_q = param(rngs, (num_heads * head_dim, d_model), spec(heads_axis, None))
    self.w_k = param(rngs, (num_heads * head_dim, d_model), spec(heads_axis, None))
    self.w_v = param(rngs, (num_heads * head_dim, d_model), spec(heads_axis, None))
    self.w_o = param(rngs, (d_model, num_heads * head_dim), spec(None, None))

  def __call__(self, x: jax.Array) -> jax.Array:
    batch_spec = list(jax.typeof(x).sharding.spec)[:1] or [None]

    def heads(w):  # [B, T, Y, X, H, D] bf16: the grid whole, the heads split over heads_axis
      h = split_heads(dense(x, w[...], self.backend), self.num_heads)
      return split_like(h, (*batch_spec, None, None, None, self.heads_axis, None))

    q, k, v = heads(self.w_q), heads(self.w_k), heads(self.w_v)
    q = (q * self.head_dim**-0.5).astype(q.dtype)
    o = ops.neighborhood_attention_3d(q, k, v, kernel_size=self.kernel_size, backend=self.backend)
    o = whole(o.reshape(*o.shape[:-2], -1), 4)  # every head: the output projection contracts them
    return sharded_like(dense(o, self.w_o[...], self.backend).astype(x.dtype), x)
