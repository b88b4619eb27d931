"""A gated delta net layer (Qwen3-Next's linear attention) on `ops.gdn_prefill`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkern import ops
from jaxkern.nn.common import Axis, dense, head_specs, param, sharded_like, split_heads, split_like, whole


def _l2_normalized(x: jax.Array) -> jax.Array:
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + 1e-6)).astype(jnp.bfloat16)


class GatedDeltaNet(nnx.Module):
  """The gated delta rule over packed variable-length sequences, as
  `examples/gdn_train.py` uses it: q and k (`num_q_heads`, L2-normalized per
  head), v (`num_v_heads`, a multiple of `num_q_heads`) and the gate inputs
  a, b from projections of x (`ops.dense_gemm`), the recurrence
  (`ops.gdn_prefill`, decay exp(-exp(A_log) softplus(a + dt_bias)), write
  strength sigmoid(b), scale head_dim**-0.5), an output projection. (No
  short convolution or output gate: the recurrence and its projections
  only.)

  `x` [T, d_model] packed tokens (any float dtype), `cu_seqlens` [N + 1]
  int32 (sequence n is tokens cu_seqlens[n] .. cu_seqlens[n+1] - 1, as the
  op takes them), `initial_state` [N, HV, D, D] f32 (k-last; zeros if
  None). Returns [T, d_model] in x's dtype, with the final states [N, HV,
  D, D] f32 when `return_state`. head_dim is a power of two >= 16.

  Parameters (float32): `w_q`, `w_k` [HQ * D, d_model], `w_v` [HV * D,
  d_model], `w_a`, `w_b` [HV, d_model], `w_o` [d_model, HV * D] (LeCun
  normal); `A_log` [HV] (log of U(1, 16)) and `dt_bias` [HV] (softplus^-1
  of a log-uniform dt in [1e-3, 0.1]), Qwen3-Next's initial ranges.

  `backend` goes to every op call. `heads_axis`: the mesh axis q, k, v, a, b
  and the per-head parameters are split over by heads (HQ and HV each
  divisible by its size), the output projection replicated; the packed
  tokens are never split (the recurrence runs along them: gathered before
  the op). The output has x's sharding.
  """

  def __init__(
    self,
    d_model: int,
    num_q_heads: int,
    num_v_heads: int,
    head_dim: int,
    *,
    backend: ops.Backend = None,
    heads_axis: Axis = None,
    rngs: nnx.Rngs,
  ):
    if num_q_heads < 1 or num_v_heads % num_q_heads:
      raise ValueError(f"num_v_heads={num_v_heads} must be a multiple of num_q_heads={num_q_heads}")
    self.num_q_heads, self.num_v_heads, self.head_dim = num_q_heads, num_v_heads, head_dim
    self.backend: ops.Backend = backend
    self.heads_axis = heads_axis
    spec = head_specs(heads_axis)
    self.w_q = param(rngs, (num_q_heads * head_dim, d_model), spec(heads_axis, None))
    self.w_k = param(rngs, (num_q_heads * head_dim, d_model), spec(heads_axis, None))
    self.w_v = param(rngs, (num_v_heads * head_dim, d_model), spec(heads_axis, None))
    self.w_a = param(rngs, (num_v_heads, d_model), spec(heads_axis, None))
    self.w_b = param(rngs, (num_v_heads, d_model), spec(heads_axis, None))
    self.w_o = param(rngs, (d_model, num_v_heads * head_dim), spec(None, None))

    def a_log(key, shape, dtype):
      return jnp.log(jax.random.uniform(key, shape, dtype, minval=1.0, maxval=16.0))

    def dt_bias(key, shape, dtype):
      dt = jnp.exp(jax.random.uniform(key, shape, dtype, minval=np.log(1e-3), maxval=np.log(1e-1)))
      return dt + jnp.log(-jnp.expm1(-dt))  # softplus^-1(dt)

    self.A_log = param(rngs, (num_v_heads,), spec(heads_axis), init=a_log)
    self.dt_bias = param(rngs, (num_v_heads,), spec(heads_axis), init=dt_bias)

  def __call__(
    self,
    x: jax.Array,
    cu_seqlens: jax.Array,
    *,
    initial_state: jax.Array | None = None,
    return_state: bool = False,
  ) -> jax.Array | tuple[jax.Array, jax.Array]:
    hq, hv, d = self.num_q_heads, self.num_v_heads, self.head_dim

    def heads(w, count):  # [T, count, D] bf16, tokens whole, heads split over heads_axis
      return split_like(split_heads(dense(x, w, self.backend), count), (None, self.heads_axis, None))

    q = _l2_normalized(heads(self.w_q[...], hq))
    k = _l2_normalized(heads(self.w_k[...], hq))
    v = heads(self.w_v[...], hv)
    a, b = (split_like(dense(x, w[...], self.backend), (None, self.heads_axis)) for w in (self.w_a, self.w_b))
    if initial_state is None:
      initial_state = jnp.zeros((cu_seqlens.shape[0] - 1, hv, d, d), jnp.float32)
    o, state = ops.gdn_prefill(
      q, k, v, initial_state, self.A_log[...], a, self.dt_bias[...], b, cu_seqlens, backend=self.backend
    )
    o = whole(o.reshape(o.shape[0], hv * d), 1)  # every head: the output projection contracts them
    y = sharded_like(dense(o, self.w_o[...], self.backend).astype(x.dtype), x)
    return (y, state) if return_state else y
