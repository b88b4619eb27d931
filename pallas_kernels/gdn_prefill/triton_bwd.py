"""Backward pass of the chunk-parallel gated delta net prefill
(`pallas_kernels.gdn_prefill`, whose docstring has the forward's chunk
math and notation), in the form of flash-linear-attention's
`chunk_gated_delta_rule_bwd`: four launches after the forward's launches 1
and 2 are recomputed (`gdn_prefill.chunked_forward`: G, W and the state H
entering every chunk).

Per chunk, with R = diag(beta) (V - diag(e) K S) the residual (so that
V' = T R), Ô = O / scale, dÔ = scale dO and dS_next the cotangent of the
state leaving the chunk:

    dV'  = M^T dÔ + diag(e_C / e) K dS_next           (all of V's uses)
    dS   = Q^T diag(e) dÔ + e_C dS_next - W^T dV'      (the state entering)

which is a reverse recurrence over a sequence's chunks; then, in parallel
over chunks, with dR = T^T dV' and dA = -strictly_lower(dR V'^T):

    dV = diag(beta) dR
    dQ = diag(e) dÔ S^T + (D * dÔ V'^T) K
    dK = -diag(e beta) dR S^T + diag(e_C / e) V' dS_next^T
         + (D * dÔ V'^T)^T Q + P K + P^T K             with P = diag(beta) dA * D
    dbeta_i = sum_v dR X + sum_j dA D (K K^T)           (X = V - diag(e) K S)

and the gradient of the cumulative log-decay G (through e, D, e_C / e and
e_C), summed from the end of the chunk into the per-token log-decay gamma.
`gdn_prefill` maps (dgamma, dbeta) to the gate inputs.

1. `gdn_prefill_bwd_dv`, grid (chunk slots, HV, V / block_v): M^T dÔ and
   the carry-free term of the reverse pass, (Q^T diag(e) dÔ)^T, per chunk.
2. `gdn_prefill_bwd_state`, grid (N, HV, V / block_v): the reverse state
   pass, walking a sequence's chunks from its last, storing dV' and the
   cotangent of the state leaving every chunk; the initial state's
   gradient at the end (0 for an empty sequence, whose new_state is 0
   whatever its state).
3. `gdn_prefill_bwd_chunk`, grid (chunk slots, HV): V' (from the chunk's
   state), the WY inverse's backward, dV, dbeta, the D-terms of dgamma
   and d(scale), and the [C, C] cotangents of Q K^T and K K^T.
4. `gdn_prefill_bwd_dqk`, grid (chunk slots, HV, K / block_k): dq and dk
   per v-head (the v-heads sharing a q/k head are summed afterwards) and
   the terms of dgamma and d(scale) through S and dS_next, per K block.
   (Launches 3 and 4 are one computation split where one launch spilled:
   docs/perf/kernel_notes.md.)

Chunks of no sequence write zero gradients (their tokens reach no output).
Dots with fp32 operands are split as in the forward (`gdn_chunks.mm`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.gdn_prefill import chunks as gc
from pallas_kernels.gdn_prefill.config import ChunkBwdStage, DqkStage, DvStage, GdnPrefillBwdConfig, StateBwdStage
from pallas_kernels.shared import common
from pallas_kernels.shared.device import num_sms


def choose_backward_config(num_seqs: int, v_heads: int, v_dim: int) -> GdnPrefillBwdConfig:
  """Chunk 64; the reverse state pass, the critical path, takes `block_v`
  32, or 16 where 32 leaves fewer than two programs per SM (the forward
  state pass's rule); the other launches are parallel over chunks. The
  chunk launch inverts in blocks of 32: with blocks of 16 ptxas 13.5 spills
  its inverse (docs/perf/sm90a_backward.md)."""
  fit = lambda block: min(block, v_dim)  # noqa: E731
  block_v = fit(32)
  if block_v > 16 and num_seqs * v_heads * (v_dim // block_v) < 2 * num_sms():
    block_v = 16
  return GdnPrefillBwdConfig(
    dv=DvStage(block_v=fit(64)),
    state=StateBwdStage(block_v=block_v),
    chunk_grads=ChunkBwdStage(block_v=fit(16), solve_block=32),
    dqk=DqkStage(block_k=fit(32), block_v=fit(32)),
  )


def _from_the_end(dg):
  """Gradient of the per-token gamma from that of G_i = sum_{j <= i} gamma_j:
  dgamma_j = sum_{i >= j} dG_i."""
  return jnp.sum(dg) - jnp.cumsum(dg) + dg


# ------------------------------------------------------------ launch 1


def _dv_kernel(
  start_ref, end_ref, scale_ref, q_ref, k_ref, g_ref, do_ref, dvi_ref, qdo_ref, *, chunk: int, precision: str
):
  # q, k refs: [T, K]; do, dvi refs: [T, block_v]; g ref: [T]; qdo ref:
  # [block_v, K]. The carry-free parts of the reverse state pass: M^T dÔ
  # and (Q^T diag(e) dÔ)^T.
  c = pl.program_id(0)
  tokens, valid = gc.chunk_rows(start_ref[c], end_ref[c], chunk)
  cum, q, m = gc.decayed_scores(q_ref, k_ref, g_ref, tokens, valid, precision)
  do = scale_ref[...] * gc.load_rows(do_ref, tokens, valid).astype(jnp.float32)
  gc.store_rows(dvi_ref, tokens, valid, gc.mm(m, do, (0, 0), precision))
  qdo_ref[...] = gc.mm(jnp.exp(cum)[:, None] * do, q, (0, 0), precision)


# ------------------------------------------------------------ launch 2


def _state_bwd_kernel(
  first_ref,
  cu_ref,
  k_ref,
  g_ref,
  w_ref,
  dvi_ref,
  qdo_ref,
  ds_final_ref,
  dsn_ref,
  dvp_ref,
  dstate_ref,
  *,
  chunk: int,
  precision: str,
):
  # k, w refs: [T, K]; g ref: [T]; dvi, dvp refs: [T, block_v]; ds_final,
  # dstate refs: [block_v, K]; qdo, dsn refs: [slots, block_v, K].
  n = pl.program_id(0)
  start, end = cu_ref[n], cu_ref[n + 1]
  chunks = (end - start + chunk - 1) // chunk
  mm = functools.partial(gc.mm, precision=precision)

  def body(step, ds):  # ds: [block_v, K] fp32, the cotangent of the state leaving the chunk
    slot = first_ref[n] + chunks - 1 - step
    dsn_ref[slot] = ds
    tokens, valid = gc.chunk_rows(start + (chunks - 1 - step) * chunk, end, chunk)
    cum = gc.load_rows(g_ref, tokens, valid)
    last = jnp.min(cum)  # G at the chunk's last token (rows past it read 0)
    dv = gc.load_rows(dvi_ref, tokens, valid) + jnp.exp(last - cum)[:, None] * mm(
      gc.load_rows(k_ref, tokens, valid), ds, (1, 1)
    )
    gc.store_rows(dvp_ref, tokens, valid, dv)
    return jnp.exp(last) * ds + qdo_ref[slot] - mm(dv, gc.load_rows(w_ref, tokens, valid), (0, 0))

  ds = lax.fori_loop(0, chunks, body, ds_final_ref[...])
  # An empty sequence's new_state is 0 whatever its state: no gradient.
  dstate_ref[...] = jnp.where(end > start, ds, 0.0)


# ------------------------------------------------------------ launch 3


def _chunk_bwd_kernel(
  start_ref,
  end_ref,
  real_ref,
  scale_ref,
  a_log_ref,
  dt_bias_ref,
  q_ref,
  k_ref,
  v_ref,
  a_ref,
  b_ref,
  h_ref,
  do_ref,
  dvp_ref,
  dv_ref,
  vf_ref,
  dm_ref,
  p_ref,
  dgamma_ref,
  dbeta_ref,
  dscale_ref,
  *,
  chunk: int,
  block_v: int,
  solve_block: int,
  precision: str,
):
  # q, k refs: [T, K]; v, do, dvp, dv, vf refs: [T, V]; a, b, dgamma,
  # dbeta, dscale refs: [T]; h ref: [V, K] (the state entering the chunk,
  # k-last); dm, p refs: [C, C]. The terms of the gate and scale gradients
  # that need S or dS_next by more than V' are launch 4's.
  c = pl.program_id(0)
  tokens, valid = gc.chunk_rows(start_ref[c], end_ref[c], chunk)
  real = real_ref[c] > 0
  scale = scale_ref[...]
  mm = functools.partial(gc.mm, precision=precision)
  gamma, beta = gc.chunk_gates(a_ref, b_ref, tokens, valid, a_log_ref[...], dt_bias_ref[...])
  cum = jnp.cumsum(gamma)
  e, f = jnp.exp(cum), jnp.exp(jnp.sum(gamma) - cum)  # the sum: G at the last row
  k = gc.load_rows(k_ref, tokens, valid)
  decay = gc.decay_matrix(cum)
  kk = mm(k, k, (1, 1))
  t_inv = gc.unit_lower_inverse(beta[:, None] * gc.strictly_lower(decay * kk), solve_block)
  zero = lambda x: jnp.where(real, x, 0.0)  # noqa: E731

  def v_block(j, carry):
    drv, dov, dbeta = carry
    cols = pl.ds(j * block_v, block_v)
    v = gc.load_rows(v_ref, tokens, valid, cols).astype(jnp.float32)
    x = v - e[:, None] * mm(k, h_ref[cols, :], (1, 1))  # V - diag(e) K S
    v_new = mm(t_inv, beta[:, None] * x, (1, 0))  # V' = T R
    dr = mm(t_inv, gc.load_rows(dvp_ref, tokens, valid, cols), (0, 0))  # T^T dV'
    gc.store_rows(dv_ref, tokens, valid, zero(beta[:, None] * dr), cols)
    gc.store_rows(vf_ref, tokens, valid, f[:, None] * v_new, cols)
    do = gc.load_rows(do_ref, tokens, valid, cols).astype(jnp.float32)
    return drv + mm(dr, v_new, (1, 1)), dov + mm(do, v_new, (1, 1)), dbeta + jnp.sum(dr * x, axis=1)

  square = jnp.zeros((chunk, chunk), jnp.float32)
  init = (square, square, jnp.zeros((chunk,), jnp.float32))
  drv, dov, dbeta = lax.fori_loop(0, v_ref.shape[1] // block_v, v_block, init)

  qk = mm(gc.load_rows(q_ref, tokens, valid), k, (1, 1))
  da = -gc.strictly_lower(drv)
  dm_ref[...] = zero(scale * dov * decay)  # d(Q K^T), lower with the diagonal
  p_ref[...] = zero(beta[:, None] * da * decay)  # d(K K^T), strictly lower
  dd = (beta[:, None] * da * kk + scale * dov * qk) * decay  # d(D) * D: D's share of dG
  dg = jnp.sum(dd, axis=1) - jnp.sum(dd, axis=0)
  gc.store_rows(dgamma_ref, tokens, valid, zero(_from_the_end(dg)))
  gc.store_rows(dbeta_ref, tokens, valid, zero(dbeta + jnp.sum(da * decay * kk, axis=1)))
  # d(scale) * scale = <dO, O>: the intra-chunk term (launch 4: the state's).
  gc.store_rows(dscale_ref, tokens, valid, zero(jnp.sum(dov * decay * qk, axis=1)))


# ------------------------------------------------------------ launch 4


def _dqk_kernel(
  start_ref,
  end_ref,
  real_ref,
  scale_ref,
  a_log_ref,
  dt_bias_ref,
  q_ref,
  k_ref,
  a_ref,
  h_ref,
  dsn_ref,
  do_ref,
  dv_ref,
  vf_ref,
  dm_ref,
  p_ref,
  dq_ref,
  dk_ref,
  dgamma_ref,
  dscale_ref,
  *,
  chunk: int,
  block_v: int,
  precision: str,
):
  # q, k, dq, dk refs: [T, block_k]; a, dgamma, dscale refs: [T]; h, dsn
  # refs: [V, block_k]; do, dv, vf refs: [T, V]; dm, p refs: [C, C].
  # dgamma and dscale: this K block's share of the terms through S and dS_next.
  c = pl.program_id(0)
  tokens, valid = gc.chunk_rows(start_ref[c], end_ref[c], chunk)
  real = real_ref[c] > 0
  scale = scale_ref[...]
  mm = functools.partial(gc.mm, precision=precision)
  gamma = gc.chunk_log_decay(a_ref, tokens, valid, a_log_ref[...], dt_bias_ref[...])
  e = jnp.exp(jnp.cumsum(gamma))

  def v_block(j, carry):
    do_s, dv_s, vf_ds, s_ds = carry
    cols = pl.ds(j * block_v, block_v)
    s, ds = h_ref[cols, :], dsn_ref[cols, :]  # [block_v, block_k]
    do = gc.load_rows(do_ref, tokens, valid, cols).astype(jnp.float32)
    return (
      do_s + mm(do, s, (1, 0)),  # dO S^T
      dv_s + mm(gc.load_rows(dv_ref, tokens, valid, cols), s, (1, 0)),  # diag(beta) dR S^T
      vf_ds + mm(gc.load_rows(vf_ref, tokens, valid, cols), ds, (1, 0)),  # diag(e_C / e) V' dS_next^T
      s_ds + jnp.sum(jnp.sum(s * ds, axis=1)),
    )  # one axis at a time: lowers under a mesh

  tile = jnp.zeros((chunk, q_ref.shape[1]), jnp.float32)
  do_s, dv_s, vf_ds, s_ds = lax.fori_loop(
    0, do_ref.shape[1] // block_v, v_block, (tile, tile, tile, jnp.zeros((), jnp.float32))
  )
  q = gc.load_rows(q_ref, tokens, valid)
  k = gc.load_rows(k_ref, tokens, valid)
  dm, p = dm_ref[...], p_ref[...]
  dq = scale * e[:, None] * do_s + mm(dm, k, (1, 0))
  dk = vf_ds - e[:, None] * dv_s + mm(dm, q, (0, 0)) + mm(p, k, (1, 0)) + mm(p, k, (0, 0))
  gc.store_rows(dq_ref, tokens, valid, jnp.where(real, dq, 0.0))
  gc.store_rows(dk_ref, tokens, valid, jnp.where(real, dk, 0.0))
  # Row sums over this block's K columns: <dO_i, (Q S)_i>, <dV_i, (K S)_i>
  # and <(e_C / e) V'_i, (K dS_next)_i>; then dG through e, e_C / e and e_C.
  qf, kf = q.astype(jnp.float32), k.astype(jnp.float32)
  de_out = jnp.sum(qf * do_s, axis=1)
  df = jnp.sum(kf * vf_ds, axis=1)
  dg = e * (scale * de_out - jnp.sum(kf * dv_s, axis=1)) - df
  dg = dg + jnp.where(jnp.arange(chunk) == chunk - 1, jnp.sum(df) + jnp.exp(jnp.sum(gamma)) * s_ds, 0.0)
  gc.store_rows(dgamma_ref, tokens, valid, jnp.where(real, _from_the_end(dg), 0.0))
  gc.store_rows(dscale_ref, tokens, valid, jnp.where(real, e * de_out, 0.0))


# ------------------------------------------------------------ launcher


class ChunkGrads(NamedTuple):
  """What the four launches give, per v-head: dq, dk [T, HV, K] fp32
  (to be summed over the v-heads of a q/k head), dv [T, HV, V] fp32, dgamma
  and dbeta [T, HV] (of the per-token log-decay and beta), dscale_rows
  [T, HV] (summing to d(scale)), dstate [N, HV, V, K]."""

  dq: jax.Array
  dk: jax.Array
  dv: jax.Array
  dgamma: jax.Array
  dbeta: jax.Array
  dscale_rows: jax.Array
  dstate: jax.Array


def chunk_backward(
  q,
  k,
  v,
  A_log,
  a,
  dt_bias,
  b,
  table: gc.ChunkTable,
  scale,
  g,
  w,
  h,
  d_out,
  d_new_state,
  *,
  config: GdnPrefillBwdConfig,
  precision: str,
  interpret: bool,
) -> ChunkGrads:
  """Launches 1-4 over `table` (chunks of `config.chunk` tokens), given the
  recomputed forward's cumulative log-decay `g` [T, HV], `w` [T, HV, K] and
  chunk-entry states `h` [slots, HV, V, K], and the cotangents of the
  output and the new state."""
  total, hq, d = q.shape
  num_seqs, hv = d_new_state.shape[:2]
  group = hv // hq
  slots = table.slot_start.shape[0]
  chunk = config.chunk
  f32 = jnp.float32
  rows = lambda *lead: jax.ShapeDtypeStruct((*lead,), f32)  # noqa: E731
  whole = lambda n: pl.BlockSpec((n,), lambda *_: (0,))  # noqa: E731
  slot_args = (table.slot_start, table.slot_end)

  bd = min(config.dv.block_v, d)
  qk_rows = pl.BlockSpec((total, None, d), lambda c, h, j: (0, h // group, 0))
  dvi, qdo = common.pallas_call(
    functools.partial(_dv_kernel, chunk=chunk, precision=precision),
    out_shape=(rows(total, hv, d), rows(slots, hv, d, d)),
    grid=(slots, hv, d // bd),
    in_specs=[
      whole(slots),
      whole(slots),
      whole(1),
      qk_rows,
      qk_rows,
      pl.BlockSpec((total, None), lambda c, h, j: (0, h)),
      pl.BlockSpec((total, None, bd), lambda c, h, j: (0, h, j)),
    ],
    out_specs=(
      pl.BlockSpec((total, None, bd), lambda c, h, j: (0, h, j)),
      pl.BlockSpec((None, None, bd, d), lambda c, h, j: (c, h, j, 0)),
    ),
    compiler_params=common.compiler_params(config.dv),
    interpret=interpret,
    name="gdn_prefill_bwd_dv",
  )(*slot_args, scale, q, k, g, d_out)

  bs = min(config.state.block_v, d)
  v_block = pl.BlockSpec((total, None, bs), lambda n, h, j: (0, h, j))
  state_block = pl.BlockSpec((None, None, bs, d), lambda n, h, j: (n, h, j, 0))
  slot_states = pl.BlockSpec((slots, None, bs, d), lambda n, h, j: (0, h, j, 0))
  dsn, dvp, dstate = common.pallas_call(
    functools.partial(_state_bwd_kernel, chunk=chunk, precision=precision),
    out_shape=(rows(slots, hv, d, d), rows(total, hv, d), rows(*d_new_state.shape)),
    grid=(num_seqs, hv, d // bs),
    in_specs=[
      whole(num_seqs),
      whole(num_seqs + 1),
      pl.BlockSpec((total, None, d), lambda n, h, j: (0, h // group, 0)),
      pl.BlockSpec((total, None), lambda n, h, j: (0, h)),
      pl.BlockSpec((total, None, d), lambda n, h, j: (0, h, 0)),
      v_block,
      slot_states,
      state_block,
    ],
    out_specs=(slot_states, v_block, state_block),
    compiler_params=common.compiler_params(config.state),
    interpret=interpret,
    name="gdn_prefill_bwd_state",
  )(table.seq_first_slot, table.cu, k, g, w, dvi, qdo, d_new_state)

  stage = config.chunk_grads
  head = pl.BlockSpec((1,), lambda c, h: (h,))
  qk_rows = pl.BlockSpec((total, None, d), lambda c, h: (0, h // group, 0))
  v_rows = pl.BlockSpec((total, None, d), lambda c, h: (0, h, 0))
  gate_rows = pl.BlockSpec((total, None), lambda c, h: (0, h))
  slot_state = pl.BlockSpec((None, None, d, d), lambda c, h: (c, h, 0, 0))
  slot_square = pl.BlockSpec((None, None, chunk, chunk), lambda c, h: (c, h, 0, 0))
  dv, vf, dm, p, dgamma, dbeta, dscale_rows = common.pallas_call(
    functools.partial(
      _chunk_bwd_kernel,
      chunk=chunk,
      block_v=min(stage.block_v, d),
      solve_block=min(stage.solve_block, chunk),
      precision=precision,
    ),
    out_shape=(
      rows(total, hv, d),
      rows(total, hv, d),
      rows(slots, hv, chunk, chunk),
      rows(slots, hv, chunk, chunk),
      rows(total, hv),
      rows(total, hv),
      rows(total, hv),
    ),
    grid=(slots, hv),
    in_specs=[
      whole(slots),
      whole(slots),
      whole(slots),
      whole(1),
      head,
      head,
      qk_rows,
      qk_rows,
      v_rows,
      gate_rows,
      gate_rows,
      slot_state,
      v_rows,
      v_rows,
    ],
    out_specs=(v_rows, v_rows, slot_square, slot_square, gate_rows, gate_rows, gate_rows),
    compiler_params=common.compiler_params(stage),
    interpret=interpret,
    name="gdn_prefill_bwd_chunk",
  )(*slot_args, table.slot_real, scale, A_log, dt_bias, q, k, v, a, b, h, d_out, dvp)

  stage = config.dqk
  bk = min(stage.block_k, d)
  head = pl.BlockSpec((1,), lambda c, h, j: (h,))
  qk_cols = pl.BlockSpec((total, None, bk), lambda c, h, j: (0, h // group, j))
  v_rows = pl.BlockSpec((total, None, d), lambda c, h, j: (0, h, 0))
  slot_state = pl.BlockSpec((None, None, d, bk), lambda c, h, j: (c, h, 0, j))
  slot_square = pl.BlockSpec((None, None, chunk, chunk), lambda c, h, j: (c, h, 0, 0))
  per_v_head = pl.BlockSpec((total, None, bk), lambda c, h, j: (0, h, j))
  per_k_block = pl.BlockSpec((total, None, None), lambda c, h, j: (0, h, j))
  dq, dk, dgamma_state, dscale_state = common.pallas_call(
    functools.partial(_dqk_kernel, chunk=chunk, block_v=min(stage.block_v, d), precision=precision),
    out_shape=(rows(total, hv, d), rows(total, hv, d), rows(total, hv, d // bk), rows(total, hv, d // bk)),
    grid=(slots, hv, d // bk),
    in_specs=[
      whole(slots),
      whole(slots),
      whole(slots),
      whole(1),
      head,
      head,
      qk_cols,
      qk_cols,
      pl.BlockSpec((total, None), lambda c, h, j: (0, h)),
      slot_state,
      slot_state,
      v_rows,
      v_rows,
      v_rows,
      slot_square,
      slot_square,
    ],
    out_specs=(per_v_head, per_v_head, per_k_block, per_k_block),
    compiler_params=common.compiler_params(stage),
    interpret=interpret,
    name="gdn_prefill_bwd_dqk",
  )(*slot_args, table.slot_real, scale, A_log, dt_bias, q, k, a, h, dsn, d_out, dv, vf, dm, p)
  return ChunkGrads(
    dq, dk, dv, dgamma + dgamma_state.sum(axis=2), dbeta, dscale_rows + dscale_state.sum(axis=2), dstate
  )
