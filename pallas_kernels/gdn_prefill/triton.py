"""Gated delta net (Qwen3-Next linear attention) prefill over packed
variable-length sequences on the Pallas Triton lowering, k-last state
`[.., V, K]`, in the chunk-parallel form of flash-linear-attention's
`chunk_gated_delta_rule`. Math and gates: `pallas_kernels.gdn_decode`; chunk
table, split dots and the blocked inverse: `pallas_kernels.gdn_prefill.chunks`.

Per chunk of C tokens of one sequence and v-head, with G the inclusive
cumulative log-decay inside the chunk, e = exp(G), D_ij = exp(G_i - G_j) for
j <= i (else 0) and S the state `[K, V]` entering the chunk:

    A  = strictly_lower(diag(beta) D * (K K^T))       T = (I + A)^-1
    W  = T diag(beta e) K                             U = T diag(beta) V
    M  = D * (Q K^T)                                  (causal, with the diagonal)
    V' = U - W S                                      (the chunk's new values)
    O  = scale (diag(e) Q S + M V')
    S1 = e_C S + K^T diag(e_C / e) V'

Three launches (form "chunked"):
1. `gdn_prefill_intra`, grid (chunk slots, HV): the chunk's W, U (fp32)
   and G, independent of the state. T comes from a blocked inverse
   (`gdn_chunks.unit_lower_inverse`: 16x16 diagonal blocks, block forward
   substitution, exact fp32 dots of 16^3); the rest are tensor-core dots.
2. `gdn_prefill_state`, grid (N, HV, V / block_v): the state pass, walking
   the sequence's chunks with two products per chunk (W S and K^T V'),
   storing V' (fp32) and the state entering each chunk (H, rounded to
   bf16; the carried state stays fp32) and the final state.
3. `gdn_prefill_output`, grid (chunk slots, HV, V / block_v): M recomputed
   from Q, K and G, then O = scale (diag(e) Q H + M V'), zero on chunks of
   no sequence.

What crosses HBM between launches is G, W, U, V' and H: no [C, K] or
[C, V] array that launch 3 could recompute from the inputs. V' stays
fp32: with near-duplicate keys it has large entries that cancel in M V',
and bf16 V' misses the bf16 output tolerance there.

Form "serial" (one launch, grid (N, HV, V / block_v)) walks each sequence's
chunks in one program and does all of a chunk's work there: fewer launches
and no intermediate arrays, for prefills so short that every sequence is
one chunk (`choose_config`).

Dots with an fp32 operand split it into bf16 high and low parts
(`dot_precision="bf16x3"`: about 16 mantissa bits; `"bf16"`: the high part
only); bf16 inputs enter as they are (exact products); the carried state
stays fp32.

`cu_seqlens` follows `gdn_chunks.normalize_cu_seqlens` (clamped to [0, T],
nondecreasing); an empty sequence writes a zero new_state row and tokens of
no sequence a zero output.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.gdn_decode.triton import check_common, log_decay, resolve_scale, sigmoid
from pallas_kernels.gdn_prefill import chunks as gc
from pallas_kernels.gdn_prefill.config import GdnPrefillConfig, OutputStage, SerialStage, StateStage
from pallas_kernels.gdn_prefill.triton_bwd import choose_backward_config, chunk_backward
from pallas_kernels.shared import common
from pallas_kernels.shared.common import resolve_interpret

# ------------------------------------------------------------ launch 1


def _intra_kernel(
  start_ref,
  end_ref,
  a_log_ref,
  dt_bias_ref,
  k_ref,
  v_ref,
  a_ref,
  b_ref,
  g_ref,
  w_ref,
  u_ref,
  *,
  chunk: int,
  block_d: int,
  solve_block: int,
  precision: str,
):
  # k, w refs: [T, K]; v, u refs: [T, V]; a, b, g refs: [T].
  c = pl.program_id(0)
  tokens, valid = gc.chunk_rows(start_ref[c], end_ref[c], chunk)
  mm = functools.partial(gc.mm, precision=precision)
  gamma, beta = gc.chunk_gates(a_ref, b_ref, tokens, valid, a_log_ref[...], dt_bias_ref[...])
  cum = jnp.cumsum(gamma)
  gc.store_rows(g_ref, tokens, valid, cum)
  k = gc.load_rows(k_ref, tokens, valid)
  decay = gc.decay_matrix(cum)
  a_mat = beta[:, None] * gc.strictly_lower(decay * mm(k, k, (1, 1)))
  tb = gc.unit_lower_inverse(a_mat, solve_block) * beta[None, :]  # T diag(beta)
  tbe = tb * jnp.exp(cum)[None, :]  # T diag(beta e)
  for j in range(k_ref.shape[1] // block_d):
    cols = pl.ds(j * block_d, block_d)
    gc.store_rows(w_ref, tokens, valid, mm(tbe, gc.load_rows(k_ref, tokens, valid, cols), (1, 0)), cols)
  for j in range(v_ref.shape[1] // block_d):
    cols = pl.ds(j * block_d, block_d)
    gc.store_rows(u_ref, tokens, valid, mm(tb, gc.load_rows(v_ref, tokens, valid, cols), (1, 0)), cols)


# ------------------------------------------------------------ launch 2


def _state_kernel(
  first_ref, cu_ref, k_ref, g_ref, w_ref, u_ref, state_ref, h_ref, new_state_ref, *vn_ref, chunk: int, precision: str
):
  # k, w refs: [T, K]; u ref and the optional vn ref (V', for launch 3):
  # [T, block_v]; g ref: [T]; state refs: [block_v, K]; h ref: [slots, block_v, K].
  n = pl.program_id(0)
  start, end = cu_ref[n], cu_ref[n + 1]
  mm = functools.partial(gc.mm, precision=precision)

  def body(i, s):  # s: [block_v, K] fp32, the state S^T entering the chunk
    h_ref[first_ref[n] + i] = s.astype(h_ref.dtype)
    tokens, valid = gc.chunk_rows(start + i * chunk, end, chunk)
    cum = gc.load_rows(g_ref, tokens, valid)
    last = jnp.min(cum)  # G at the chunk's last token (rows past it read 0)
    v_new = gc.load_rows(u_ref, tokens, valid) - mm(gc.load_rows(w_ref, tokens, valid), s, (1, 1))
    for ref in vn_ref:
      gc.store_rows(ref, tokens, valid, v_new)
    k = gc.load_rows(k_ref, tokens, valid)
    return jnp.exp(last) * s + mm(jnp.exp(last - cum)[:, None] * v_new, k, (0, 0))

  s = lax.fori_loop(0, (end - start + chunk - 1) // chunk, body, state_ref[...])
  # An empty sequence gets a zero row (the definition's rule), not its input.
  new_state_ref[...] = jnp.where(end > start, s, 0.0)


# ------------------------------------------------------------ launch 3


def _output_kernel(
  start_ref, end_ref, real_ref, scale_ref, q_ref, k_ref, g_ref, vn_ref, h_ref, o_ref, *, chunk: int, precision: str
):
  # q, k refs: [T, K]; g ref: [T]; vn (V'), o refs: [T, block_v]; h ref:
  # [block_v, K]. O = scale (diag(e) Q S + M V'), M recomputed from Q, K, G.
  c = pl.program_id(0)
  tokens, valid = gc.chunk_rows(start_ref[c], end_ref[c], chunk)
  cum, q, m = gc.decayed_scores(q_ref, k_ref, g_ref, tokens, valid, precision)
  o = jnp.exp(cum)[:, None] * gc.mm(q, h_ref[...], (1, 1), precision) + gc.mm(
    m, gc.load_rows(vn_ref, tokens, valid), (1, 0), precision
  )
  # Chunks of no sequence have no state (H unwritten there): selected away.
  gc.store_rows(o_ref, tokens, valid, jnp.where(real_ref[c] > 0, o * scale_ref[...], 0.0))


# ------------------------------------------------------- form "serial"


def _substitution_inverse(a):
  """(I + a)^-1 for strictly lower-triangular `a` [C, C] (fp32) by forward
  substitution, row i = e_i - a[i, :] @ T: C - 1 masked row steps on CUDA
  cores. Fewer live registers than the blocked inverse, which spills next
  to the carried state of this form; fine for its 32-token chunks."""
  chunk = a.shape[0]
  rows = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
  cols = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
  eye = (rows == cols).astype(jnp.float32)

  def body(i, t):
    a_row = jnp.sum(jnp.where(rows == i, a, 0.0), axis=0)  # a[i, :] as [C] (index j)
    return jnp.where(rows == i, eye - jnp.sum(a_row[:, None] * t, axis=0)[None, :], t)

  return lax.fori_loop(1, chunk, body, eye)


def _serial_kernel(
  scale_ref,
  a_log_ref,
  dt_bias_ref,
  cu_ref,
  q_ref,
  k_ref,
  v_ref,
  a_ref,
  b_ref,
  state_ref,
  o_ref,
  new_state_ref,
  *,
  chunk: int,
  precision: str,
):
  # q, k refs: [T, K]; v, o refs: [T, block_v]; a, b refs: [T]; state refs:
  # [block_v, K]. The same chunk math as launches 1-3, in one program per
  # (sequence, v-head, V block), residual form: V' = T diag(beta) (V - diag(e) K S).
  n = pl.program_id(0)
  start, end = cu_ref[n], cu_ref[n + 1]
  mm = functools.partial(gc.mm, precision=precision)

  def body(i, s):  # s: [block_v, K] fp32, the state S^T entering the chunk
    tokens, valid = gc.chunk_rows(start + i * chunk, end, chunk)
    gamma, beta = gc.chunk_gates(a_ref, b_ref, tokens, valid, a_log_ref[...], dt_bias_ref[...])
    cum = jnp.cumsum(gamma)
    last = jnp.sum(gamma)
    k = gc.load_rows(k_ref, tokens, valid)
    t_inv = _substitution_inverse(beta[:, None] * gc.strictly_lower(gc.decay_matrix(cum) * mm(k, k, (1, 1))))
    v = gc.load_rows(v_ref, tokens, valid).astype(jnp.float32)
    v_new = mm(t_inv, beta[:, None] * (v - jnp.exp(cum)[:, None] * mm(k, s, (1, 1))), (1, 0))
    q = gc.load_rows(q_ref, tokens, valid)
    o = jnp.exp(cum)[:, None] * mm(q, s, (1, 1)) + mm(gc.decay_matrix(cum) * mm(q, k, (1, 1)), v_new, (1, 0))
    gc.store_rows(o_ref, tokens, valid, o * scale_ref[...])
    return jnp.exp(last) * s + mm(jnp.exp(last - cum)[:, None] * v_new, k, (0, 0))

  s = lax.fori_loop(0, (end - start + chunk - 1) // chunk, body, state_ref[...])
  new_state_ref[...] = jnp.where(end > start, s, 0.0)


# ------------------------------------------------------------ heuristic


class GdnPrefillSizes(NamedTuple):
  """Problem sizes of the inputs' shapes (input name -> array or ShapeDtypeStruct)."""

  tokens: int
  num_seqs: int
  v_heads: int
  v_dim: int  # state rows per head

  @classmethod
  def of(cls, shapes: Mapping[str, Any]) -> GdnPrefillSizes:
    num_seqs, v_heads, v_dim, _ = shapes["state"].shape
    return cls(int(shapes["q"].shape[0]), int(num_seqs), int(v_heads), int(v_dim))


def choose_config(shapes: Mapping[str, jax.ShapeDtypeStruct]) -> GdnPrefillConfig:
  """Chunked with chunk 64 (register figures of every launch:
  docs/perf/kernel_notes.md), unless T <= 32: then every sequence fits one
  32-token chunk and the serial form does the same work in one launch
  instead of three, without the intermediate arrays. The state pass, the
  critical path, takes `block_v` 16 in one stage: with V' and the bf16
  chunk states written from it, 32 rows (or a second stage's prefetch)
  reach 255 registers and spill with jax 0.11.2's compiler (the sm_90a
  report); 16 rows also give twice the programs for few long sequences.
  Launches 1 and 3 are parallel over chunks anyway."""
  tokens, num_seqs, hv, v_dim = GdnPrefillSizes.of(shapes)
  backward = choose_backward_config(num_seqs, hv, v_dim)
  if tokens <= 32:
    return GdnPrefillConfig(form="serial", chunk=32, serial=SerialStage(block_v=min(32, v_dim)), backward=backward)
  return GdnPrefillConfig(
    state=StateStage(block_v=min(16, v_dim), num_stages=1),
    output=OutputStage(block_v=min(64, v_dim)),
    backward=backward,
  )


def candidate_configs(shapes: Mapping[str, jax.ShapeDtypeStruct]) -> list[GdnPrefillConfig]:
  """The heuristic's choice first, then chunked variants (state blocks 16
  and 32) and the serial form at chunk 32. Left out: the single-bf16 dots
  (they miss the output tolerance on correlated keys, see
  `GdnPrefillConfig`) and the chunked form at chunk 32 (its output launch
  spills on sm_90a)."""
  v_dim = GdnPrefillSizes.of(shapes).v_dim
  fit = lambda block: min(block, v_dim)  # noqa: E731
  chunked = [GdnPrefillConfig(state=StateStage(block_v=fit(16))), GdnPrefillConfig(state=StateStage(block_v=fit(32)))]
  serial = [
    GdnPrefillConfig(form="serial", chunk=32, serial=SerialStage(block_v=fit(32))),
    GdnPrefillConfig(form="serial", chunk=32, serial=SerialStage(block_v=fit(64), num_warps=8)),
  ]
  return list(dict.fromkeys([choose_config(shapes), *chunked, *serial]))


# ------------------------------------------------------------ launchers


class Forward(NamedTuple):
  """What the chunked forward computes: the outputs (None without launch 3)
  and, for the backward, the states entering every chunk slot (`h` [slots,
  HV, V, K], fp32 without launch 3, else bf16; slots of no sequence
  unwritten), the cumulative log-decay `g` [T, HV] and `w` [T, HV, K]."""

  output: jax.Array | None
  new_state: jax.Array
  h: jax.Array
  g: jax.Array
  w: jax.Array


def chunked_forward(
  q,
  k,
  v,
  state,
  A_log,
  a,
  dt_bias,
  b,
  table: gc.ChunkTable,
  scale,
  *,
  config: GdnPrefillConfig,
  interpret: bool,
  with_output: bool = True,
) -> Forward:
  """Launches 1-3 over the chunk table `table` (`gdn_chunks.chunk_table`);
  launches 1-2 only without `with_output` (what the backward recomputes).
  With launch 3, launch 2 also stores V' and rounds the chunk states `h` to
  bf16 (they only reach the bf16 output; the carried state and new_state
  stay fp32); without it (the backward, whose V' recompute from `h`
  subtracts near-equal terms) `h` stays fp32 and V' is not stored."""
  total, hq, d = q.shape
  num_seqs, hv = state.shape[:2]
  group = hv // hq
  slots = table.slot_start.shape[0]
  chunk, intra = config.chunk, config.intra
  f32 = jnp.float32
  whole = lambda n: pl.BlockSpec((n,), lambda *_: (0,))  # noqa: E731
  head = pl.BlockSpec((1,), lambda c, h: (h,))
  qk_rows = pl.BlockSpec((total, None, d), lambda c, h: (0, h // group, 0))
  v_rows = pl.BlockSpec((total, None, d), lambda c, h: (0, h, 0))
  gate_rows = pl.BlockSpec((total, None), lambda c, h: (0, h))
  g, w, u = common.pallas_call(
    functools.partial(
      _intra_kernel,
      chunk=chunk,
      block_d=min(intra.block_d, d),
      solve_block=min(intra.solve_block, chunk),
      precision=config.dot_precision,
    ),
    out_shape=(jax.ShapeDtypeStruct((total, hv), f32), *(jax.ShapeDtypeStruct((total, hv, d), f32) for _ in range(2))),
    grid=(slots, hv),
    in_specs=[whole(slots), whole(slots), head, head, qk_rows, v_rows, gate_rows, gate_rows],
    out_specs=(gate_rows, v_rows, v_rows),
    compiler_params=common.compiler_params(intra),
    interpret=interpret,
    name="gdn_prefill_intra",
  )(table.slot_start, table.slot_end, A_log, dt_bias, k, v, a, b)

  bv = min(config.state.block_v, d)
  v_block = pl.BlockSpec((total, None, bv), lambda n, h, j: (0, h, j))
  # For launch 3: V' (bf16) and the chunk states in bf16; fp32 states for the backward.
  for_output = ((jax.ShapeDtypeStruct(v.shape, f32),), (v_block,)) if with_output else ((), ())
  h, new_state, *v_new = common.pallas_call(
    functools.partial(_state_kernel, chunk=chunk, precision=config.dot_precision),
    out_shape=(
      jax.ShapeDtypeStruct((slots, hv, d, d), jnp.bfloat16 if with_output else f32),
      jax.ShapeDtypeStruct(state.shape, f32),
      *for_output[0],
    ),
    grid=(num_seqs, hv, d // bv),
    in_specs=[
      whole(num_seqs),
      whole(num_seqs + 1),
      pl.BlockSpec((total, None, d), lambda n, h, j: (0, h // group, 0)),
      pl.BlockSpec((total, None), lambda n, h, j: (0, h)),
      pl.BlockSpec((total, None, d), lambda n, h, j: (0, h, 0)),
      v_block,
      pl.BlockSpec((None, None, bv, d), lambda n, h, j: (n, h, j, 0)),
    ],
    out_specs=(
      pl.BlockSpec((slots, None, bv, d), lambda n, h, j: (0, h, j, 0)),
      pl.BlockSpec((None, None, bv, d), lambda n, h, j: (n, h, j, 0)),
      *for_output[1],
    ),
    compiler_params=common.compiler_params(config.state),
    interpret=interpret,
    name="gdn_prefill_state",
  )(table.seq_first_slot, table.cu, k, g, w, u, state)
  if not with_output:
    return Forward(None, new_state, h, g, w)

  bo = min(config.output.block_v, d)
  output = common.pallas_call(
    functools.partial(_output_kernel, chunk=chunk, precision=config.dot_precision),
    out_shape=jax.ShapeDtypeStruct(v.shape, jnp.bfloat16),
    grid=(slots, hv, d // bo),
    in_specs=[
      whole(slots),
      whole(slots),
      whole(slots),
      whole(1),
      pl.BlockSpec((total, None, d), lambda c, h, j: (0, h // group, 0)),
      pl.BlockSpec((total, None, d), lambda c, h, j: (0, h // group, 0)),
      pl.BlockSpec((total, None), lambda c, h, j: (0, h)),
      pl.BlockSpec((total, None, bo), lambda c, h, j: (0, h, j)),
      pl.BlockSpec((None, None, bo, d), lambda c, h, j: (c, h, j, 0)),
    ],
    out_specs=pl.BlockSpec((total, None, bo), lambda c, h, j: (0, h, j)),
    compiler_params=common.compiler_params(config.output),
    interpret=interpret,
    name="gdn_prefill_output",
  )(table.slot_start, table.slot_end, table.slot_real, scale, q, k, g, v_new[0], h)
  return Forward(output, new_state, h, g, w)


def serial_forward(q, k, v, state, A_log, a, dt_bias, b, cu, scale, *, config: GdnPrefillConfig, interpret: bool):
  """Form "serial": one launch over (sequence, v-head, V block); tokens of
  no sequence (where `cu` leaves any) are zeroed afterwards."""
  total, hq, d = q.shape
  hv = state.shape[1]
  group = hv // hq
  bv = min(config.serial.block_v, d)
  qk_spec = pl.BlockSpec((total, None, d), lambda n, h, j: (0, h // group, 0))
  v_spec = pl.BlockSpec((total, None, bv), lambda n, h, j: (0, h, j))
  gate_spec = pl.BlockSpec((total, None), lambda n, h, j: (0, h))
  head_spec = pl.BlockSpec((1,), lambda n, h, j: (h,))
  state_spec = pl.BlockSpec((None, None, bv, d), lambda n, h, j: (n, h, j, 0))
  out, new_state = common.pallas_call(
    functools.partial(_serial_kernel, chunk=config.chunk, precision=config.dot_precision),
    out_shape=(jax.ShapeDtypeStruct(v.shape, jnp.bfloat16), jax.ShapeDtypeStruct(state.shape, jnp.float32)),
    grid=(state.shape[0], hv, d // bv),
    in_specs=[
      pl.BlockSpec((1,), lambda n, h, j: (0,)),
      head_spec,
      head_spec,
      pl.BlockSpec((cu.shape[0],), lambda n, h, j: (0,)),
      qk_spec,
      qk_spec,
      v_spec,
      gate_spec,
      gate_spec,
      state_spec,
    ],
    out_specs=(v_spec, state_spec),
    compiler_params=common.compiler_params(config.serial),
    interpret=interpret,
    name="gdn_prefill_serial",
  )(scale, A_log, dt_bias, cu, q, k, v, a, b, state)
  covered = gc.covered_tokens(cu, total)
  return jnp.where(covered[:, None, None], out, jnp.zeros((), out.dtype)), new_state


def check_prefill(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens) -> None:
  """Raises ValueError naming the argument whose shape does not fit."""
  total = q.shape[0]
  check_common(q, k, v, a, b, A_log, dt_bias, lead=(total,))
  num_seqs, hv, d = state.shape[0], v.shape[1], v.shape[2]
  if state.shape != (num_seqs, hv, d, d):
    raise ValueError(f"state {state.shape} != (num_seqs, {hv}, {d}, {d})")
  if cu_seqlens.shape != (num_seqs + 1,):
    raise ValueError(f"cu_seqlens {cu_seqlens.shape} != ({num_seqs + 1},) (num_seqs + 1 from state)")


def _forward(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, *, config: GdnPrefillConfig, interpret: bool):
  total = q.shape[0]
  if config.form == "serial":
    cu = gc.normalize_cu_seqlens(cu_seqlens, total)
    return serial_forward(q, k, v, state, A_log, a, dt_bias, b, cu, scale, config=config, interpret=interpret)
  fwd = chunked_forward(
    q,
    k,
    v,
    state,
    A_log,
    a,
    dt_bias,
    b,
    gc.chunk_table(cu_seqlens, total, config.chunk),
    scale,
    config=config,
    interpret=interpret,
  )
  return fwd.output, fwd.new_state


class _Static(NamedTuple):
  config: GdnPrefillConfig
  interpret: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(10,))
def _prefill(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, static: _Static):
  return _forward(
    q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, config=static.config, interpret=static.interpret
  )


def _prefill_fwd(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale, static: _Static):
  # Only the inputs are kept: the backward recomputes launches 1-2 at its
  # own chunk (`gdn_prefill_bwd`), whatever the forward's form.
  args = (q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale)
  return _forward(*args, config=static.config, interpret=static.interpret), args


def _prefill_bwd(static: _Static, residuals, cotangents):
  q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale = residuals
  d_out, d_new_state = cotangents
  total, hq, d = q.shape
  config = static.config
  bwd = config.backward
  table = gc.chunk_table(cu_seqlens, total, bwd.chunk)
  fwd = chunked_forward(
    q,
    k,
    v,
    state,
    A_log,
    a,
    dt_bias,
    b,
    table,
    scale,
    config=dataclasses.replace(config, form="chunked", chunk=bwd.chunk),
    interpret=static.interpret,
    with_output=False,
  )
  grads = chunk_backward(
    q,
    k,
    v,
    A_log,
    a,
    dt_bias,
    b,
    table,
    scale,
    fwd.g,
    fwd.w,
    fwd.h,
    d_out,
    d_new_state.astype(jnp.float32),
    config=bwd,
    precision=config.dot_precision,
    interpret=static.interpret,
  )
  per_qk_head = lambda x: x.reshape(total, hq, -1, d).sum(axis=2)  # noqa: E731
  # The gates' own chain rule, on tokens some sequence covers (elsewhere
  # dgamma = dbeta = 0, and a NaN gate there must not make 0 * NaN).
  covered = gc.covered_tokens(table.cu, total)[:, None]
  live = lambda x: jnp.where(covered, x, jnp.zeros((), x.dtype))  # noqa: E731
  _, gate_vjp = jax.vjp(
    lambda a, A_log, dt_bias, b: (log_decay(a, A_log, dt_bias), sigmoid(b)), live(a), A_log, dt_bias, live(b)
  )
  da, dA_log, ddt_bias, db = gate_vjp((grads.dgamma, grads.dbeta))
  return (
    per_qk_head(grads.dq).astype(q.dtype),
    per_qk_head(grads.dk).astype(k.dtype),
    grads.dv.astype(v.dtype),
    grads.dstate,
    dA_log,
    da.astype(a.dtype),
    ddt_bias,
    db.astype(b.dtype),
    None,
    jnp.sum(grads.dscale_rows).reshape(scale.shape),
  )


_prefill.defvjp(_prefill_fwd, _prefill_bwd)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def gdn_prefill(
  q,
  k,
  v,
  state,
  A_log,
  a,
  dt_bias,
  b,
  cu_seqlens,
  scale=None,
  *,
  config: GdnPrefillConfig | None = None,
  interpret: bool | None = None,
):
  """Gated delta rule over packed variable-length sequences.

  Args:
    q, k: `[T, HQ, D]` bf16; v: `[T, HV, D]` bf16; a, b: `[T, HV]`;
    A_log, dt_bias: `[HV]` f32; state: `[N, HV, D(V), D(K)]` f32 (k-last),
    the initial state of each sequence; cu_seqlens: `[N + 1]` integer
    (clamped to [0, T] and made nondecreasing: `gdn_chunks`); scale: 0-d f32
    (0 or None -> 1/sqrt(D)).
  Returns:
    `(output [T, HV, D] bf16, new_state [N, HV, D, D] f32)`; a sequence with
    no tokens gets a zero new_state row, a token of no sequence a zero output.

  Differentiable (`jax.custom_vjp`, chunk-parallel backward kernels,
  `gdn_prefill_bwd`) in q, k, v, state, the gate inputs (A_log, a,
  dt_bias, b) and scale; tokens of no sequence get zero gradients.
  """
  check_prefill(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens)
  total, d = q.shape[0], q.shape[2]
  if total == 0 or state.shape[0] == 0:  # Nothing to run: every sequence is empty.
    return jnp.zeros(v.shape, jnp.bfloat16), jnp.zeros(state.shape, jnp.float32)
  shapes = {"q": jax.ShapeDtypeStruct(q.shape, q.dtype), "state": jax.ShapeDtypeStruct(state.shape, state.dtype)}
  config = choose_config(shapes) if config is None else config
  args = (q, k, v, state.astype(jnp.float32), A_log.astype(jnp.float32), a, dt_bias.astype(jnp.float32), b)
  return _prefill(*args, cu_seqlens, resolve_scale(scale, d).reshape(1), _Static(config, resolve_interpret(interpret)))
