"""DeepSeek sparse multi-head latent attention on `ops.sparse_mla_prefill`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkern import ops
from jaxkern.nn.common import Axis, dense, head_specs, param, sharded_like, split_heads, split_like, whole


class SparseMLA(nnx.Module):
  """Sparse multi-head latent attention in MLA's absorbed form: every token
  has one latent row (`latent_dim` features) that is both its key and its
  value, shared by all heads; each query head attends to the latent rows
  `indices` selects for its token (DeepSeek's top-k sparse attention), with
  a learned per-head sink logit in the softmax denominator.

  * q = x `w_q` per head ([M, H, latent_dim]: the key up-projection
    absorbed into the query projection), latent rows kv = context `w_kv`
    ([Nkv, latent_dim]; context is x itself unless given), out =
    `ops.sparse_mla_prefill(q, kv, indices, sink)` with scale
    latent_dim**-0.5, then `w_o` (the value up-projection absorbed into the
    output projection). No RoPE part.
  * `x` [M, d_model] (any float dtype), `indices` [M, TOPK] int32: rows of
    the latent (of context [Nkv, d_model] when given, else of x) each token
    attends to, -1 for an empty slot (the op's contract: an out-of-range
    index is an empty slot). Returns [M, d_model] in x's dtype; a token with
    no valid slot gets 0 from the attention.

  Parameters (float32): `w_q` [H * latent_dim, d_model], `w_kv` [latent_dim,
  d_model], `w_o` [d_model, H * latent_dim] (LeCun normal), `attn_sink` [H]
  (zeros). The Pallas kernels take num_heads a multiple of 16.

  `backend` goes to every op call. `heads_axis`: the mesh axis the heads are
  split over (the query projection's output features and the sinks; the
  latent and output projections replicated). Tokens split as x is split;
  the latent rows never (indices address all of them: gathered before the
  op). The output has x's sharding.
  """

  def __init__(
    self,
    d_model: int,
    num_heads: int,
    latent_dim: int,
    *,
    backend: ops.Backend = None,
    heads_axis: Axis = None,
    rngs: nnx.Rngs,
  ):
    self.num_heads, self.latent_dim = num_heads, latent_dim
    self.backend: ops.Backend = backend
    self.heads_axis = heads_axis
    spec = head_specs(heads_axis)
    self.w_q = param(rngs, (num_heads * latent_dim, d_model), spec(heads_axis, None))
    self.w_kv = param(rngs, (latent_dim, d_model), spec(None, None))
    self.w_o = param(rngs, (d_model, num_heads * latent_dim), spec(None, None))
    self.attn_sink = param(rngs, (num_heads,), spec(heads_axis), init=nnx.initializers.zeros_init())

  def __call__(self, x: jax.Array, indices: jax.Array, context: jax.Array | None = None) -> jax.Array:
    q = split_heads(dense(x, self.w_q[...], self.backend), self.num_heads)
    token_spec = list(jax.typeof(q).sharding.spec)[:1] or [None]
    q = split_like(q, (*token_spec, self.heads_axis, None))
    kv = whole(dense(x if context is None else context, self.w_kv[...], self.backend), 0)
    out, _ = ops.sparse_mla_prefill(
      q, kv, indices, self.attn_sink[...], sm_scale=self.latent_dim**-0.5, backend=self.backend
    )
    out = whole(out.reshape(out.shape[0], -1), 1)  # every head: the output projection contracts them
    return sharded_like(dense(out, self.w_o[...], self.backend).astype(x.dtype), x)


def causal_window_indices(tokens: int, window: int) -> jax.Array:
  """[tokens, window] int32: token i attends to tokens i - window + 1 .. i
  (-1 for the slots before the first token), a simple `indices` for
  `SparseMLA` self-attention (a trained indexer would pick top-k instead)."""
  rows = jnp.arange(tokens, dtype=jnp.int32)[:, None] - jnp.arange(window, dtype=jnp.int32)[None, ::-1]
  return jnp.where(rows >= 0, rows, -1)
