"""Flash attention backward (FlashAttention-2) on the Pallas Triton lowering.

From the forward's output `o`, its per-row log-sum-exp `lse` (base 2 of
the scaled scores, +inf for a row that sees no key) and the output
cotangent `do`:

    delta_i = sum_d do_id o_id                 (XLA, one fused reduction)
    p_ij    = exp2(s_ij - lse_i)               s = q k^T sm_scale log2(e); 0 where hidden
    dv_j    = sum_i p_ij do_i
    ds_ij   = p_ij (do_i . v_j - delta_i)
    dq_i    = sm_scale sum_j ds_ij k_j
    dk_j    = sm_scale sum_i ds_ij q_i
    dsm     = sum_ij ds_ij (q_i . k_j) = sum_i q_i . (dq_i / sm_scale)

Two kernels, both in fp32 with `p` and `ds` rounded to the input dtype for
their dots (as every flash backward does), each launched only when a
gradient needs it:

* `flash_attention_bwd_dq`: grid (query blocks, B, H); walks the key blocks
  of its query block exactly as the forward does (`flash_attention_keys`:
  prefix, unmasked, masked, skipped), recomputing `p` from `lse`.
* `flash_attention_bwd_dkdv`: grid (key blocks, B, H); owns `block_k_dkv`
  keys and walks the query blocks that see some of them
  (`query_block_limits`); prefix keys, which every query sees, have their
  own launch `flash_attention_bwd_dkdv_prefix`.

The forward's features: under a band the dQ walk is the forward's and the
dK/dV walk visits the query blocks whose rows' intervals touch its keys
(`keys.Band.query_blocks`, `keys.band_query_block_limits` when packed);
with a soft cap `ds` is multiplied by `1 - tanh**2` of the capped score
(`keys.Logits`); with grouped heads the dK/dV grid runs over the K/V heads
and each program sums the group's query heads; a cotangent of the returned
lse enters as `delta_i - dlse_i` (natural log).

Hidden keys get exactly zero dk and dv, and a NaN or Inf in them reaches no
gradient: their probabilities are selected to 0 and their rows of k and v to
0 before any dot. A row that sees no key has `lse = +inf`, so every `p` of
it is 0 and its dq is 0.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.flash_attention.config import FlashAttentionBwdConfig
from pallas_kernels.flash_attention.keys import (
  INVISIBLE_SEGMENT,
  Band,
  Keys,
  Logits,
  Window,
  band_query_block_limits,
  in_interval,
  key_block_limits,
  kv_head_map,
  load_rows,
  query_block_limits,
  store_rows,
  walk_keys,
)
from pallas_kernels.shared import common
from pallas_kernels.shared.common import cdiv, fit_block
from pallas_kernels.shared.device import num_sms
from pallas_kernels.shared.online_softmax import LOG2_E, hide_keys


def fit_backward_config(config: FlashAttentionBwdConfig, q_len: int, kv_len: int) -> FlashAttentionBwdConfig:
  """Shrinks the blocks to the problem (tiny Nq or Nk; `kv_len` the longer
  key source)."""
  return dataclasses.replace(
    config,
    block_q_dq=fit_block(config.block_q_dq, q_len),
    block_k_dq=fit_block(config.block_k_dq, kv_len),
    block_k_dkv=fit_block(config.block_k_dkv, kv_len),
    block_q_dkv=fit_block(config.block_q_dkv, q_len),
  )


def choose_backward_config(
  *, batch: int, heads: int, q_len: int, kv_len: int, head_dim: int
) -> FlashAttentionBwdConfig:
  """Heuristic, the forward's reasoning: 128-row programs on 8 warps (each
  warpgroup owns 64 rows: every dot is a 64-row wgmma), dQ walking keys 64
  at a time; dK/dV walking queries 64 at a time at D = 64 and 32 at a time
  at D >= 128, where two fp32 `[128, D]` accumulators are live (237
  registers with every mask and a prefix, no spills on sm_90a: `python -m
  jaxkern.aot --backward`). When 128-row query blocks would leave fewer
  than two programs per SM, D = 64 takes 64-row programs on 4 warps.
  `kv_len` is the longer key source."""
  programs_at_128 = batch * heads * cdiv(q_len, 128)
  if head_dim >= 128:
    config = FlashAttentionBwdConfig(128, 64, 128, 32, num_warps=8, num_stages=2)
  elif programs_at_128 >= 2 * num_sms():
    config = FlashAttentionBwdConfig(128, 64, 128, 64, num_warps=8, num_stages=2)
  else:
    config = FlashAttentionBwdConfig(64, 64, 64, 64, num_warps=4, num_stages=2)
  return fit_backward_config(config, q_len, kv_len)


def backward_config_for(
  config: FlashAttentionBwdConfig | None, *, batch: int, heads: int, q_len: int, kv_len: int, head_dim: int
) -> FlashAttentionBwdConfig:
  """A launcher's backward tiling: the caller's `config` fitted to the
  problem, else `choose_backward_config`'s. `kv_len` is the longer key
  source."""
  if config is None:
    return choose_backward_config(batch=batch, heads=heads, q_len=q_len, kv_len=kv_len, head_dim=head_dim)
  return fit_backward_config(config, q_len, kv_len)


def _dq_kernel(
  *,
  scale_ref,
  q_ref,
  k_ref,
  v_ref,
  k_prefix_ref,
  v_prefix_ref,
  key_valid_ref,
  segment_ids_ref,
  block_limits_ref,
  rows_lo_ref,
  rows_hi_ref,
  do_ref,
  lse_ref,
  delta_ref,
  dq_ref,
  dscale_ref,
  block_q: int,
  block_k: int,
  q_len: int,
  kv_len: int,
  prefix_len: int,
  window: Window | None,
  softcap: float | None,
):
  # As the forward's operands, then do [bq, D], lse [bq], delta [bq]; out:
  # dq [bq, D] and, when asked, dscale [bq] f32.
  keys = Keys(
    k_ref,
    v_ref,
    kv_len,
    block_k,
    k_prefix_ref,
    v_prefix_ref,
    prefix_len,
    key_valid=key_valid_ref,
    segment_ids=segment_ids_ref,
    block_limits=block_limits_ref,
  )
  has_segments, with_dscale = segment_ids_ref is not None, dscale_ref is not None
  sm_scale = scale_ref[0]
  logits = Logits.of(sm_scale, softcap)

  q_start = pl.program_id(0) * block_q
  ragged = q_len % block_q != 0
  valid = q_len - q_start
  q = load_rows(q_ref, 0, block_q, valid, 0.0, ragged)
  do = load_rows(do_ref, 0, block_q, valid, 0.0, ragged)
  lse = load_rows(lse_ref, 0, block_q, valid, jnp.inf, ragged)  # padding rows: p = 0
  delta = load_rows(delta_ref, 0, block_q, valid, 0.0, ragged)
  q_segments = load_rows(keys.segment_ids, q_start, block_q, q_len, 0, ragged) if has_segments else None
  band = None
  if window is not None:
    band = Band(window, q_len, kv_len, rows_lo_ref, rows_hi_ref).rows(q_start, block_q, block_k)

  def step(k, v, visible, dq):
    s, slope = logits.scores(jnp.dot(q, k.T, preferred_element_type=jnp.float32))
    p = jnp.exp2(s - lse[:, None])
    if visible is not None:
      p = jnp.where(visible, p, 0.0)
    dp = jnp.dot(do, v.T, preferred_element_type=jnp.float32)
    ds = p * (dp - delta[:, None])
    if slope is not None:  # through the soft cap
      ds = ds * slope
    return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

  dq = walk_keys(step, jnp.zeros(q.shape, jnp.float32), keys, q_segments, band)
  store_rows(dq_ref, (dq * sm_scale).astype(dq_ref.dtype), valid, ragged)
  if with_dscale:  # sum_j ds_ij (q_i . k_j), per row
    store_rows(dscale_ref, jnp.sum(q.astype(jnp.float32) * dq, axis=1), valid, ragged)


def _dkdv_kernel(
  *,
  scale_ref,
  q_ref,
  k_ref,
  v_ref,
  key_valid_ref,
  segment_ids_ref,
  block_limits_ref,
  rows_lo_ref,
  rows_hi_ref,
  band_limits_ref,
  do_ref,
  lse_ref,
  delta_ref,
  dk_ref,
  dv_ref,
  block_q: int,
  block_k: int,
  q_len: int,
  kv_len: int,
  group: int,
  window: Window | None,
  softcap: float | None,
):
  # scale [1] f32; q [Nq, D] (grouped heads: [Nq, G, D], the group's query
  # heads); k, v [bk, D]; optional key_valid [Nk] int8, segment_ids [N]
  # int32, block_limits [2] int32, a packed band's rows_lo, rows_hi [Nq]
  # int32 and band_limits [2] int32; do like q, lse, delta [Nq] ([G, Nq]);
  # out: dk, dv [bk, D], summed over the group.
  has_key_valid, has_segments = key_valid_ref is not None, segment_ids_ref is not None
  limits_ref = block_limits_ref
  sm_scale = scale_ref[0]
  logits = Logits.of(sm_scale, softcap)

  k_start = pl.program_id(0) * block_k
  ragged_k = kv_len % block_k != 0
  k = load_rows(k_ref, 0, block_k, kv_len - k_start, 0.0, ragged_k)
  v = load_rows(v_ref, 0, block_k, kv_len - k_start, 0.0, ragged_k)
  key_visible = None
  if has_key_valid:
    key_visible = load_rows(key_valid_ref, k_start, block_k, kv_len, 0, ragged_k) != 0
    k, v = hide_keys(k, key_visible), hide_keys(v, key_visible)
    key_visible = key_visible[:, None]
  if has_segments:
    k_segments = load_rows(segment_ids_ref, k_start, block_k, kv_len, INVISIBLE_SEGMENT, ragged_k)
  if limits_ref is not None:
    first, end = limits_ref[0], limits_ref[1]
  else:
    first, end = 0, cdiv(q_len, block_q)
  band = None
  if window is not None:
    band = Band(window, q_len, kv_len, rows_lo_ref, rows_hi_ref)
    if window.packed:
      band_first, band_end = band_limits_ref[0], band_limits_ref[1]
    else:
      band_first, band_end = band.query_blocks(k_start, block_k, block_q)
    first = jnp.maximum(first, band_first)
    end = jnp.maximum(jnp.minimum(end, band_end), first)
  ragged_q = q_len % block_q != 0

  def query_block(head):
    """The fold over the query blocks of one query head: `head` of the
    group's (refs `[Nq, G, D]`, `[G, Nq]`), or None without groups (refs
    `[Nq, D]`, `[Nq]`)."""

    def body(block, carry):
      dk, dv = carry
      start = block * block_q
      q = load_rows(q_ref, start, block_q, q_len, 0.0, ragged_q, head)
      do = load_rows(do_ref, start, block_q, q_len, 0.0, ragged_q, head)
      lse = load_rows(lse_ref, start, block_q, q_len, jnp.inf, ragged_q, head)  # padding rows: p = 0
      delta = load_rows(delta_ref, start, block_q, q_len, 0.0, ragged_q, head)
      # Transposed scores [bk, bq]: the program's keys are the rows.
      s, slope = logits.scores(jnp.dot(k, q.T, preferred_element_type=jnp.float32))
      p = jnp.exp2(s - lse[None, :])
      visible = key_visible
      if has_segments:
        q_segments = load_rows(segment_ids_ref, start, block_q, q_len, 0, ragged_q)
        by_segment = k_segments[:, None] <= q_segments[None, :]
        visible = by_segment if visible is None else visible & by_segment
      if band is not None:
        lo, hi = band.intervals(start, block_q)
        by_band = in_interval(k_start + jnp.arange(block_k)[:, None], lo[None, :], hi[None, :])
        visible = by_band if visible is None else visible & by_band
      if visible is not None:
        p = jnp.where(visible, p, 0.0)
      dv = dv + jnp.dot(p.astype(do.dtype), do, preferred_element_type=jnp.float32)
      ds = p * (jnp.dot(v, do.T, preferred_element_type=jnp.float32) - delta[None, :])
      if slope is not None:  # through the soft cap
        ds = ds * slope
      dk = dk + jnp.dot(ds.astype(q.dtype), q, preferred_element_type=jnp.float32)
      return dk, dv

    return body

  zeros = jnp.zeros(k.shape, jnp.float32)
  if group == 1:
    dk, dv = lax.fori_loop(first, end, query_block(None), (zeros, zeros))
  else:  # the group's query heads in turn, each over the same query blocks
    dk, dv = lax.fori_loop(0, group, lambda g, carry: lax.fori_loop(first, end, query_block(g), carry), (zeros, zeros))
  store_rows(dk_ref, (dk * sm_scale).astype(dk_ref.dtype), kv_len - k_start, ragged_k)
  store_rows(dv_ref, dv.astype(dv_ref.dtype), kv_len - k_start, ragged_k)


class Gradients(NamedTuple):
  """What `attention_backward` returns; None where not asked for."""

  dq: jax.Array | None
  dk: jax.Array | None
  dv: jax.Array | None
  dk_prefix: jax.Array | None
  dv_prefix: jax.Array | None
  dscale: jax.Array | None  # [1] f32


def _launch(kernel, grid, inputs, outputs, config, interpret, name):
  return common.named_pallas_call(
    kernel,
    inputs=inputs,
    outputs=outputs,
    grid=grid,
    compiler_params=common.compiler_params(config),
    interpret=interpret,
    name=name,
  )


def attention_backward(
  q,
  k,
  v,
  k_prefix,
  v_prefix,
  key_valid,
  segment_ids,
  rows_lo,
  rows_hi,
  scale,
  o,
  lse,
  do,
  *,
  config: FlashAttentionBwdConfig,
  interpret: bool,
  need_dq: bool,
  need_dkv: bool,
  need_dprefix: bool,
  need_dscale: bool,
  dlse=None,
  window: Window | None = None,
  softcap: float | None = None,
) -> Gradients:
  """The gradients of `flash_attention` (see the module docstring) from
  its saved inputs, output `o [B, Nq, H, D]`, `lse [B, H, Nq]` and the
  cotangent `do` (and `dlse`, the cotangent of the base-2 lse, when the
  forward returned it: `d lse / d s_ij = p_ij log2(e)` in natural score
  units, so it enters as `delta - dlse log2(e)`); `scale` is `[1]` f32;
  `config` already fitted; `window`, `softcap` and the packed band's rows
  `rows_lo`, `rows_hi` `[B, Nq]` as the forward's. Grouped heads (k, v
  `[B, Nk, Hkv, D]`): each dK/dV program sums its key/value head's
  gradient over the group's query heads. Each kernel launches only if a
  gradient it makes is needed."""
  batch, q_len, num_heads, head_dim = q.shape
  kv_len, kv_heads = k.shape[1], k.shape[2]
  group = num_heads // kv_heads
  kv_head = kv_head_map(group)
  prefix_len = 0 if k_prefix is None else k_prefix.shape[1]
  do = do.astype(q.dtype)
  delta = jnp.einsum("bqhd,bqhd->bhq", o.astype(jnp.float32), do.astype(jnp.float32))
  if dlse is not None:
    delta = delta - dlse.astype(jnp.float32) * LOG2_E
  scale_spec = pl.BlockSpec((1,), lambda i, b, h: (0,))
  key_valid_i8 = None if key_valid is None else key_valid.astype(jnp.int8)
  segments = None if segment_ids is None else segment_ids.astype(jnp.int32)
  has_masks = key_valid is not None or segment_ids is not None
  mask_spec = lambda n: pl.BlockSpec((None, n), lambda i, b, h: (b, 0))  # noqa: E731
  limits_spec = pl.BlockSpec((None, None, 2), lambda i, b, h: (b, i, 0))
  rows_spec = lambda n: pl.BlockSpec((None, n, None, head_dim), lambda i, b, h: (b, 0, kv_head(h), 0))  # noqa: E731
  row_stats_spec = lambda n: pl.BlockSpec((None, None, n), lambda i, b, h: (b, h, 0))  # noqa: E731
  dq = dk = dv = dk_prefix = dv_prefix = dscale = None

  if need_dq or need_dscale:
    bq, bk = config.block_q_dq, config.block_k_dq
    q_spec = pl.BlockSpec((None, bq, None, head_dim), lambda i, b, h: (b, i, h, 0))
    stats_spec = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
    limits = (
      key_block_limits(key_valid, segment_ids, batch=batch, q_len=q_len, kv_len=kv_len, block_q=bq, block_k=bk)
      if has_masks
      else None
    )
    inputs = {
      "scale": (scale, scale_spec),
      "q": (q, q_spec),
      "k": (k, rows_spec(kv_len)),
      "v": (v, rows_spec(kv_len)),
      "k_prefix": (k_prefix if prefix_len else None, rows_spec(prefix_len)),
      "v_prefix": (v_prefix if prefix_len else None, rows_spec(prefix_len)),
      "key_valid": (key_valid_i8, mask_spec(kv_len)),
      "segment_ids": (segments, mask_spec(q_len)),
      "block_limits": (limits, limits_spec),
      "rows_lo": (rows_lo, mask_spec(q_len)),
      "rows_hi": (rows_hi, mask_spec(q_len)),
      "do": (do, q_spec),
      "lse": (lse, stats_spec),
      "delta": (delta, stats_spec),
    }
    outputs = {
      "dq": (jax.ShapeDtypeStruct(q.shape, q.dtype), q_spec),
      "dscale": (jax.ShapeDtypeStruct(lse.shape, jnp.float32) if need_dscale else None, stats_spec),
    }
    kernel = functools.partial(
      _dq_kernel,
      block_q=bq,
      block_k=bk,
      q_len=q_len,
      kv_len=kv_len,
      prefix_len=prefix_len,
      window=window,
      softcap=softcap,
    )
    outs = _launch(
      kernel, (cdiv(q_len, bq), batch, num_heads), inputs, outputs, config, interpret, "flash_attention_bwd_dq"
    )
    dq = outs["dq"]
    if need_dscale:
      dscale = jnp.sum(outs["dscale"]).reshape(1)

  def dkdv(keys, values, length, masked, name):
    """dK, dV of one key source; `masked`: key_valid, segment ids and the
    band apply to it (the cached prefix is visible to every query). Grid
    (key blocks, B, Hkv); with grouped heads a program reads the group's
    query heads (`[Nq, G, D]` blocks of q and do)."""
    bq, bk = config.block_q_dkv, config.block_k_dkv
    k_spec = pl.BlockSpec((None, bk, None, head_dim), lambda j, b, h: (b, j, h, 0))
    limits = (
      query_block_limits(key_valid, segment_ids, batch=batch, q_len=q_len, kv_len=length, block_q=bq, block_k=bk)
      if masked and has_masks
      else None
    )
    band = window if masked else None
    band_limits = None
    if band is not None and band.packed:
      band_limits = band_query_block_limits(rows_lo[0], rows_hi[0], kv_len=length, block_q=bq, block_k=bk)[None]
    if group == 1:
      q_rows_spec, stats = rows_spec(q_len), row_stats_spec(q_len)
    else:
      q_rows_spec = pl.BlockSpec((None, q_len, group, head_dim), lambda j, b, h: (b, 0, h, 0))
      stats = pl.BlockSpec((None, group, q_len), lambda j, b, h: (b, h, 0))
    limits_by_key_block = pl.BlockSpec((None, None, 2), lambda j, b, h: (b, j, 0))
    inputs = {
      "scale": (scale, scale_spec),
      "q": (q, q_rows_spec),
      "k": (keys, k_spec),
      "v": (values, k_spec),
      "key_valid": (key_valid_i8 if masked else None, mask_spec(length)),
      "segment_ids": (segments if masked else None, mask_spec(q_len)),
      "block_limits": (limits, limits_by_key_block),
      "rows_lo": (rows_lo if band is not None else None, mask_spec(q_len)),
      "rows_hi": (rows_hi if band is not None else None, mask_spec(q_len)),
      "band_limits": (band_limits, limits_by_key_block),
      "do": (do, q_rows_spec),
      "lse": (lse, stats),
      "delta": (delta, stats),
    }
    shape = jax.ShapeDtypeStruct(keys.shape, keys.dtype)
    kernel = functools.partial(
      _dkdv_kernel,
      block_q=bq,
      block_k=bk,
      q_len=q_len,
      kv_len=length,
      group=group,
      window=band,
      softcap=softcap,
    )
    outs = _launch(
      kernel,
      (cdiv(length, bk), batch, kv_heads),
      inputs,
      {"dk": (shape, k_spec), "dv": (shape, k_spec)},
      config,
      interpret,
      name,
    )
    return outs["dk"], outs["dv"]

  if need_dkv:
    dk, dv = dkdv(k, v, kv_len, True, "flash_attention_bwd_dkdv")
  if need_dprefix and prefix_len:
    dk_prefix, dv_prefix = dkdv(k_prefix, v_prefix, prefix_len, False, "flash_attention_bwd_dkdv_prefix")
  return Gradients(dq, dk, dv, dk_prefix, dv_prefix, dscale)
