"""Multi-head attention on `ops.dense_gemm` and `ops.attention`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkern import ops
from jaxkern.families.flash_attention import validate_attention
from jaxkern.nn.common import Axis, dense, head_specs, param, sharded_like, split_heads, whole


class Attention(nnx.Module):
  """Multi-head self- or cross-attention: q, k, v projections
  (`ops.dense_gemm`), `ops.attention` over the heads, an output projection.

  * `x` [B, N, d_model] (any float dtype; the ops run in bf16) attends to
    itself, or to `context` [B, Nk, context_dim] (cross-attention).
    Returns [B, N, d_model] in x's dtype.
  * Packed sequences: with `cu_seqlens` (int32 [S + 1]) x is [T, d_model],
    S sequences back to back (sequence s is tokens `cu_seqlens[s]` ..
    `cu_seqlens[s + 1] - 1`, as `GatedDeltaNet` takes them), each attending
    only within itself; cross-attention then takes context [Tk,
    context_dim] and `context_cu_seqlens` [S + 1] (sequence s attends to
    its context tokens `context_cu_seqlens[s]` ..). Returns [T, d_model].
  * `key_valid` (optional) [B, Nk] bool (packed: [Tk]) hides keys (padding),
    with any of the options below.
  * `num_kv_heads` (default `num_heads`, which it must divide): grouped-query
    attention, query head h reading k/v head `h // (num_heads /
    num_kv_heads)`; the op shares each k/v head within its group (no copy
    per query head).
  * `causal=True`: query i sees keys `j <= i + Nk - Nq`, aligned
    bottom-right (self-attention: `j <= i`; cross-attention with Nq < Nk:
    the queries are the last Nq positions of the keys' sequence; Nq > Nk
    leaves the first Nq - Nk rows without keys, their output 0). Packed:
    per sequence.
  * `window=(left, right)`: query i sees keys `i' - left <= j <= i' +
    right` (`i' = i + Nk - Nq`, the same alignment), a None side
    unbounded; with `causal` the right side is 0, so `window=(w, None),
    causal=True` is a causal sliding window of w + 1 keys.
  * `softcap` c (a positive number): each score s becomes `c * tanh(s / c)`
    before masks and softmax (Gemma 2's logit soft cap).
  * Softmax scale `head_dim**-0.5`. A query that sees no key outputs 0.

  `causal`, `window` and `softcap` are `ops.attention`'s, checked by its
  contract when the layer is built (`jaxkern.InputError` naming the
  argument).

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
  parallelism); on an Explicit mesh the tokens the op cannot split are
  gathered before it (the keys always; the queries under causal, a window
  or packing, whose alignment is global). The output has x's sharding.
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
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    backend: ops.Backend = None,
    heads_axis: Axis = None,
    rngs: nnx.Rngs,
  ):
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
      raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
    head_dim = d_model // num_heads if head_dim is None else head_dim
    context_dim = d_model if context_dim is None else context_dim
    # The op's contract on the options, now rather than at the first call.
    q, kv = (jax.ShapeDtypeStruct((1, 1, heads, head_dim), jnp.bfloat16) for heads in (num_heads, num_kv_heads))
    validate_attention(q, kv, kv, causal=causal, window=window, softcap=softcap)
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.causal = causal
    self.window = None if window is None else tuple(window)
    self.softcap = softcap
    self.backend: ops.Backend = backend
    spec = head_specs(heads_axis)
    self.w_q = param(rngs, (num_heads * head_dim, d_model), spec(heads_axis, None))
    self.w_k = param(rngs, (num_kv_heads * head_dim, context_dim), spec(heads_axis, None))
    self.w_v = param(rngs, (num_kv_heads * head_dim, context_dim), spec(heads_axis, None))
    self.w_o = param(rngs, (d_model, num_heads * head_dim), spec(None, None))

  def __call__(
    self,
    x: jax.Array,
    context: jax.Array | None = None,
    *,
    key_valid: jax.Array | None = None,
    cu_seqlens: jax.Array | None = None,
    context_cu_seqlens: jax.Array | None = None,
  ) -> jax.Array:
    packed = cu_seqlens is not None
    _check_layout(x, context, packed, context_cu_seqlens)
    source = x if context is None else context
    q = split_heads(dense(x, self.w_q[...], self.backend), self.num_heads)
    k = split_heads(dense(source, self.w_k[...], self.backend), self.num_kv_heads)
    v = split_heads(dense(source, self.w_v[...], self.backend), self.num_kv_heads)
    # Gather the tokens the op cannot split (Explicit meshes; elsewhere nothing
    # happens): each query's softmax runs over all its keys, and a band's or a
    # packed sequence's alignment depends on a query's place among all tokens.
    tokens = 0 if packed else 1
    k, v = whole(k, tokens), whole(v, tokens)
    key_valid = None if key_valid is None else whole(key_valid, tokens)
    if packed or self.causal or self.window is not None:
      q = whole(q, tokens)
    packing = {}
    if packed:
      packing = {"cu_seqlens_q": cu_seqlens, "cu_seqlens_k": cu_seqlens if context is None else context_cu_seqlens}
    o = ops.attention(
      q,
      k,
      v,
      key_valid,
      causal=self.causal,
      window=self.window,
      softcap=self.softcap,
      sm_scale=self.head_dim**-0.5,
      backend=self.backend,
      **packing,
    )
    assert isinstance(o, jax.Array)  # no lse asked for
    o = o.reshape(*o.shape[:-2], -1)
    o = whole(o, o.ndim - 1)  # every head: the output projection contracts them
    return sharded_like(dense(o, self.w_o[...], self.backend).astype(x.dtype), x)


def _check_layout(x: jax.Array, context: jax.Array | None, packed: bool, context_cu_seqlens: jax.Array | None) -> None:
  """x (and context) [B, N, features], or [T, features] with cu_seqlens;
  context_cu_seqlens exactly with packed cross-attention."""
  layout, rank = ("[T, features] (packed: cu_seqlens given)", 2) if packed else ("[B, N, features]", 3)
  for name, t in (("x", x), ("context", context)):
    if t is not None and t.ndim != rank:
      raise ValueError(f"Attention: {name} must be {layout}, got shape {tuple(t.shape)}")
  if packed and context is not None and context_cu_seqlens is None:
    raise ValueError("Attention: packed cross-attention (cu_seqlens and a context) needs context_cu_seqlens [S + 1]")
  if context_cu_seqlens is not None and (not packed or context is None):
    raise ValueError("Attention: context_cu_seqlens is for packed cross-attention: pass cu_seqlens and a context")
