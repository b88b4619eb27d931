"""Gated delta net (Qwen3-Next linear attention) decode step on the Pallas
Triton lowering, k-last state `[.., V, K]`.

Math per token t and v-head h (q/k head `h // (HV // HQ)`), with the state S
viewed as `[K, V]` (stored k-last, as its transpose `[V, K]`):

    g = exp(-exp(A_log[h]) * softplus(a[t,h] + dt_bias[h])),  beta = sigmoid(b[t,h])
    S = g S;   S = S + k (beta (v - S^T k))^T;   o = scale * S^T q

All state math is fp32; q, k, v, a, b arrive in bf16 and the output is rounded
once to bf16. `scale == 0` means `1/sqrt(K)`.

Decode (`gdn_decode`): grid `(B, HV, V / block_v)`. A program owns `block_v`
rows of one (batch row, v-head) state, a `[block_v, K]` fp32 tile (K is the
contiguous axis of the k-last layout, so the tile is `block_v` contiguous rows
of 512 bytes). It computes the gates, decays the tile, forms `S^T k` and
`S^T q` as row reductions against the broadcast k and q vectors, applies the
rank-one update and writes the output slice and the new tile. Matrix-vector
work only: the kernel is bound by reading and writing the state.

The gate math (`log_decay`, `sigmoid`, `resolve_scale`) is shared with
`pallas_kernels.gdn_prefill`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gdn_decode.config import GdnDecodeConfig
from pallas_kernels.shared import common
from pallas_kernels.shared.common import check_pow2_dim, resolve_interpret
from pallas_kernels.shared.device import num_sms


class GdnDecodeSizes(NamedTuple):
  """Problem sizes of the inputs' shapes (input name -> array or ShapeDtypeStruct)."""

  batch: int
  v_heads: int
  v_dim: int  # state rows per head

  @classmethod
  def of(cls, shapes: Mapping[str, Any]) -> GdnDecodeSizes:
    batch, v_heads, v_dim, _ = shapes["state"].shape
    return cls(int(batch), int(v_heads), int(v_dim))


# ----------------------------------------------------------------- shared math


def softplus(x):
  """torch.nn.functional.softplus (beta 1, threshold 20)."""
  return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def log_decay(a, a_log, dt_bias):
  """log g = -exp(A_log) * softplus(a + dt_bias) (<= 0), fp32."""
  return -jnp.exp(a_log) * softplus(a.astype(jnp.float32) + dt_bias)


def sigmoid(x):
  return 1.0 / (1.0 + jnp.exp(-x.astype(jnp.float32)))


def resolve_scale(scale, head_size: int) -> jax.Array:
  """0-d fp32: `scale`, or 1/sqrt(head_size) where it is 0 or None."""
  default = jnp.float32(1.0 / math.sqrt(head_size))
  if scale is None:
    return default
  scale = jnp.asarray(scale, jnp.float32).reshape(())
  return jnp.where(scale == 0.0, default, scale)


def check_common(q, k, v, a, b, A_log, dt_bias, *, lead: tuple[int, ...]):
  hq, d = q.shape[-2:]
  hv = v.shape[-2]
  if k.shape != q.shape or q.shape[:-2] != lead or v.shape != (*lead, hv, d):
    raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape} do not match")
  if a.shape != (*lead, hv) or b.shape != (*lead, hv):
    raise ValueError(f"a {a.shape} / b {b.shape} != {(*lead, hv)}")
  if A_log.shape != (hv,) or dt_bias.shape != (hv,):
    raise ValueError(f"A_log {A_log.shape} / dt_bias {dt_bias.shape} != {(hv,)}")
  if hv % hq:
    raise ValueError(f"num_v_heads {hv} is not a multiple of num_q_heads {hq}")
  check_pow2_dim("head_size", d)
  return hq, hv, d


# ---------------------------------------------------------------------- decode


def _decode_kernel(
  scale_ref, a_log_ref, dt_bias_ref, q_ref, k_ref, v_ref, a_ref, b_ref, state_ref, o_ref, new_state_ref
):
  # q_ref, k_ref: [K]; v_ref, o_ref: [block_v]; state refs: [block_v, K];
  # a_ref, b_ref, a_log_ref, dt_bias_ref: [1]; scale_ref: [1].
  g = jnp.exp(log_decay(a_ref[...], a_log_ref[...], dt_bias_ref[...]))  # [1]
  beta = sigmoid(b_ref[...])  # [1]
  q = q_ref[...].astype(jnp.float32)
  k = k_ref[...].astype(jnp.float32)
  s = state_ref[...] * g[:, None]  # [block_v, K]
  predicted = jnp.sum(s * k[None, :], axis=1)  # (S^T k)[v]
  u = beta * (v_ref[...].astype(jnp.float32) - predicted)
  s = s + u[:, None] * k[None, :]
  o = jnp.sum(s * q[None, :], axis=1) * scale_ref[...]
  o_ref[...] = o.astype(o_ref.dtype)
  new_state_ref[...] = s


def choose_config(shapes: Mapping[str, jax.ShapeDtypeStruct]) -> GdnDecodeConfig:
  """Memory-bound: the largest V block that still gives >= 2 programs per SM.

  Small batches split the 128 state rows of a head over up to 8 programs (16
  rows, 8 KiB of state each) so that the state streams through more SMs."""
  batch, hv, v_dim = GdnDecodeSizes.of(shapes)
  block_v = v_dim
  while block_v > 16 and batch * hv * (v_dim // block_v) < 2 * num_sms():
    block_v //= 2
  return GdnDecodeConfig(block_v=block_v, num_warps=4 if block_v <= 32 else 8)


def candidate_configs(shapes: Mapping[str, jax.ShapeDtypeStruct]) -> list[GdnDecodeConfig]:
  v_dim = GdnDecodeSizes.of(shapes).v_dim
  chosen = choose_config(shapes)
  sweep = [GdnDecodeConfig(block_v=bv, num_warps=w) for bv in (16, 32, 64, 128) if bv <= v_dim for w in (2, 4, 8)]
  return list(dict.fromkeys([chosen, *sweep]))


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def gdn_decode(
  q,
  k,
  v,
  state,
  A_log,
  a,
  dt_bias,
  b,
  scale=None,
  *,
  config: GdnDecodeConfig | None = None,
  interpret: bool | None = None,
):
  """One decode step of the gated delta rule per sequence.

  Args:
    q, k: `[B, 1, HQ, D]` bf16 (unit L2 norm per head expected, not applied).
    v: `[B, 1, HV, D]` bf16; `a`, `b`: `[B, 1, HV]`; `A_log`, `dt_bias`: `[HV]` f32.
    state: `[B, HV, D(V), D(K)]` f32, k-last.
    scale: 0-d f32 (0 or None -> 1/sqrt(D)); may be traced.
  Returns:
    `(output [B, 1, HV, D] bf16, new_state [B, HV, D, D] f32)`.
  """
  batch = q.shape[0]
  if q.shape[1] != 1:
    raise ValueError(f"decode takes one token per sequence, got seq_len {q.shape[1]}")
  hq, hv, d = check_common(q, k, v, a, b, A_log, dt_bias, lead=(batch, 1))
  if state.shape != (batch, hv, d, d):
    raise ValueError(f"state {state.shape} != {(batch, hv, d, d)}")
  shapes = {"state": jax.ShapeDtypeStruct(state.shape, state.dtype)}
  config = choose_config(shapes) if config is None else config
  block_v = min(config.block_v, d)
  group = hv // hq
  scale = resolve_scale(scale, d).reshape(1)
  if batch == 0:
    return jnp.zeros(v.shape, jnp.bfloat16), jnp.zeros(state.shape, jnp.float32)

  qk_spec = pl.BlockSpec((None, None, None, d), lambda i, h, j: (i, 0, h // group, 0))
  v_spec = pl.BlockSpec((None, None, None, block_v), lambda i, h, j: (i, 0, h, j))
  gate_spec = pl.BlockSpec((None, None, 1), lambda i, h, j: (i, 0, h))
  head_spec = pl.BlockSpec((1,), lambda i, h, j: (h,))
  state_spec = pl.BlockSpec((None, None, block_v, d), lambda i, h, j: (i, h, j, 0))
  return common.pallas_call(
    _decode_kernel,
    out_shape=(jax.ShapeDtypeStruct(v.shape, jnp.bfloat16), jax.ShapeDtypeStruct(state.shape, jnp.float32)),
    grid=(batch, hv, d // block_v),
    in_specs=[
      pl.BlockSpec((1,), lambda i, h, j: (0,)),
      head_spec,
      head_spec,
      qk_spec,
      qk_spec,
      v_spec,
      gate_spec,
      gate_spec,
      state_spec,
    ],
    out_specs=(v_spec, state_spec),
    compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
    interpret=resolve_interpret(interpret),
    name="gdn_decode",
  )(scale, A_log.astype(jnp.float32), dt_bias.astype(jnp.float32), q, k, v, a, b, state.astype(jnp.float32))
