"""Multi-head attention on `ops.dense_gemm` and the flash attention ops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkern import ops
from jaxkern.nn.common import Axis, dense, head_specs, param, repeat_heads, sharded_like, split_heads, whole


class Attention(nnx.Module):
  """Multi-head self- or cross-attention: q, k, v projections
  (`ops.dense_gemm`), attention over the heads, an output projection.

  * `x` [B, N, d_model] (any float dtype; the ops run in bf16) attends to
    itself, or to `context` [B, Nk, context_dim] (cross-attention).
    Returns [B, N, d_model] in x's dtype.
  * `num_kv_heads` (default `num_heads`, which it must divide): grouped-query
    attention, each k/v head shared by `num_heads / num_kv_heads`
    consecutive query heads (repeated before the op).
  * `causal=True` (self-attention): token i sees tokens j <= i, through
    `ops.block_causal_attention` with one segment per token; otherwise
    `ops.attention`, with `key_valid` [B, Nk] bool hiding keys (padding).
    A key mask with `causal` is a ValueError (the causal op has none; a
    causal sequence's trailing padding is never seen by the tokens before
    it).
  * Softmax scale `head_dim**-0.5`.

  Parameters (float32, [out, in]): `w_q` [H * D, d_model], `w_k`, `w_v`
  [Hkv * D, context_dim], `w_o` [d_model, H * D]; LeCun normal.

  `backend` goes to every op call (`jaxkern.ops`: None, "xla", "pallas",
  "triton", "mosaic_gpu"). `heads_axis`: the mesh axis the heads are split
  over (tensor parallelism: the q, k and v projections' output features
  (head-major) are split over it, the output projection is replicated and
  its input's heads gathered; num_heads and num_kv_heads each divisible by
  the axis size); every parameter then carries its sharding
  (`nnx.with_partitioning`), so the layer is created under
  `jax.set_mesh(mesh)`. The batch splits however x is split (data
  parallelism); the output has x's sharding.
  """

  def __init__(
    self,
    d_model: int,
    num_heads: int,
    *,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    context_dim: int | None = None,
    causal: bool = False,
    backend: ops.Backend = None,
    heads_axis: Axis = None,
    rngs: nnx.Rngs,
  ):
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
      raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
    head_dim = d_model // num_heads if head_dim is None else head_dim
    context_dim = d_model if context_dim is None else context_dim
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.causal = causal
    self.backend: ops.Backend = backend
    spec = head_specs(heads_axis)
    self.w_q = param(rngs, (num_heads * head_dim, d_model), spec(heads_axis, None))
    self.w_k = param(rngs, (num_kv_heads * head_dim, context_dim), spec(heads_axis, None))
    self.w_v = param(rngs, (num_kv_heads * head_dim, context_dim), spec(heads_axis, None))
    self.w_o = param(rngs, (d_model, num_heads * head_dim), spec(None, None))

  def __call__(
    self, x: jax.Array, context: jax.Array | None = None, *, key_valid: jax.Array | None = None
  ) -> jax.Array:
    if self.causal and context is not None:
      raise ValueError("Attention(causal=True) is self-attention: pass no context")
    if self.causal and key_valid is not None:
      raise ValueError(
        "Attention(causal=True) takes no key_valid: ops.block_causal_attention has no key mask "
        "(a causal sequence's trailing padding is never seen by the tokens before it)"
      )
    source = x if context is None else context
    group = self.num_heads // self.num_kv_heads
    q = split_heads(dense(x, self.w_q[...], self.backend), self.num_heads)
    k = repeat_heads(split_heads(dense(source, self.w_k[...], self.backend), self.num_kv_heads), group)
    v = repeat_heads(split_heads(dense(source, self.w_v[...], self.backend), self.num_kv_heads), group)
    sm_scale = self.head_dim**-0.5
    if self.causal:
      batch, tokens = x.shape[:2]
      one_segment_per_token = jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32), (batch, tokens))
      o = ops.block_causal_attention(q, k, v, one_segment_per_token, sm_scale=sm_scale, backend=self.backend)
    else:
      o = ops.attention(q, k, v, key_valid, sm_scale=sm_scale, backend=self.backend)
    o = o.reshape(*o.shape[:-2], -1)
    o = whole(o, o.ndim - 1)  # every head: the output projection contracts them
    return sharded_like(dense(o, self.w_o[...], self.backend).astype(x.dtype), x)
