"""Flash attention (forward) on the Pallas Triton lowering.

One kernel serves three attention shapes through masks and key sources:

* dense non-causal attention, optionally with a per-key visibility mask
  (`key_valid [B, Nk]`: text cross-attention pads its keys);
* prefix-cached attention: the keys are `concat(k_prefix, k)` along the
  sequence, read from the two tensors in turn, never concatenated in HBM;
* block-causal attention over segments: `segment_ids [B, N]` on tokens that are
  both the queries and the keys; key j is visible to query i iff
  `segment_ids[j] <= segment_ids[i]`.

Static flags add the rest of `jaxkern.ops.attention`: a band (`keys.Window`:
causal, a sliding window or packed sequences; each query row sees a key
interval, `keys.Band`), grouped K/V heads (query head h reads K/V head
`h // group` through the index maps), the logit soft cap (`keys.Logits`) and
the lse output. Without them the kernel traces exactly as before.

Layout is `[B, N, H, D]` (heads not transposed in HBM). A program owns
`block_q` query rows of one (batch row, head) and walks the keys in `block_k`
steps with the online softmax of FlashAttention-2, in fp32 and base 2 (the
scale is folded into one multiply by `sm_scale * log2(e)`). The probabilities
are rounded to the value dtype for the second dot, as every flash kernel does;
the output is rounded once at the end.

Key blocks are visited in two loops: the leading blocks every query row of the
program sees are processed without any mask; the remaining blocks, up to the
last one some row sees, apply bounds, `key_valid` and segment masks. Blocks
past that are skipped. Under a band, three: masked blocks at its left edge,
unmasked blocks every row sees whole, masked blocks at its right edge; the
blocks outside it are neither loaded nor computed (`keys.RowBand`). With masks present, the two limits come from a small
per-(batch row, query block) table computed by XLA before the launch; for
nondecreasing segment ids (the recorded case) the skipped blocks are exactly
the later segments' keys.

A query row that sees no key at all (a lonely row) outputs exactly 0.

Grid: `(query blocks, B, H)`; the query-block index varies fastest, so the
programs running together share the same head's K/V in L2.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.experimental import pallas as pl

from pallas_kernels.flash_attention.config import FlashAttentionConfig
from pallas_kernels.flash_attention.keys import (
  Band,
  Keys,
  Logits,
  Window,
  band_window,
  checked_operands,
  key_block_limits,
  kv_head_map,
  load_rows,
  packed_intervals,
  packed_outputs,
  store_rows,
  walk_keys,
)
from pallas_kernels.flash_attention.triton_bwd import (
  FlashAttentionBwdConfig,
  attention_backward,
  backward_config_for,
)
from pallas_kernels.shared import common
from pallas_kernels.shared.common import cdiv, check_pow2_dim, fit_block, fitted_candidates, resolve_interpret
from pallas_kernels.shared.device import SHARED_MEMORY_PER_BLOCK, num_sms
from pallas_kernels.shared.online_softmax import init_carry, lse_for_backward, normalize, online_softmax_step


class FlashAttentionSizes(NamedTuple):
  """Problem sizes of the inputs' shapes (input name -> array or
  ShapeDtypeStruct; `k_prefix` may be absent or None)."""

  batch: int
  heads: int
  q_len: int
  kv_len: int
  prefix_len: int  # 0 without prefix keys
  head_dim: int
  itemsize: int  # bytes per q/k/v element

  @classmethod
  def of(cls, shapes: Mapping[str, Any]) -> FlashAttentionSizes:
    """Packed sequences (q `[T, H, D]`, k `[Tk, Hkv, D]`) count as one batch row."""
    q_shape, k_shape = tuple(shapes["q"].shape), tuple(shapes["k"].shape)
    if len(q_shape) == 3:
      q_shape, k_shape = (1, *q_shape), (1, *k_shape)
    batch, q_len, heads, head_dim = q_shape
    prefix = shapes.get("k_prefix")
    prefix_len = 0 if prefix is None else prefix.shape[1]
    return cls(
      int(batch),
      int(heads),
      int(q_len),
      int(k_shape[1]),
      int(prefix_len),
      int(head_dim),
      jnp.dtype(shapes["q"].dtype).itemsize,
    )

  @property
  def longest_keys(self) -> int:
    """The longer key source (Nk or Np): what caps `block_k`."""
    return max(self.kv_len, self.prefix_len)


def _fit(config: FlashAttentionConfig, q_len: int, kv_len: int) -> FlashAttentionConfig:
  """Shrinks the blocks of `config` to the problem (tiny Nq or Nk)."""
  return dataclasses.replace(
    config, block_q=fit_block(config.block_q, q_len), block_k=fit_block(config.block_k, kv_len)
  )


# What a sweep explores, before fitting to the problem. Shared memory per
# pipeline stage is 2 * block_k * D * 2 bytes (a K and a V tile) on top of the
# resident Q tile.
_SWEEP_CONFIGS = (
  FlashAttentionConfig(128, 64, num_warps=8, num_stages=3),
  FlashAttentionConfig(128, 128, num_warps=8, num_stages=3),
  FlashAttentionConfig(128, 64, num_warps=4, num_stages=3),
  FlashAttentionConfig(128, 128, num_warps=8, num_stages=2),
  FlashAttentionConfig(128, 32, num_warps=4, num_stages=4),
  FlashAttentionConfig(64, 64, num_warps=4, num_stages=3),
  FlashAttentionConfig(64, 128, num_warps=4, num_stages=2),
)

# These spill registers on sm_90a at D >= 128 and are left out of the sweep
# there (`python -m jaxkern.aot --all_candidates`; the spill sizes are in
# docs/perf/kernel_notes.md): 128x64 on 4 warps; with prefix keys also 128x32
# and 64x128 on 4 warps.
_SPILL_AT_D128 = (FlashAttentionConfig(128, 64, num_warps=4, num_stages=3),)
_SPILL_AT_D128_WITH_PREFIX = (
  FlashAttentionConfig(128, 32, num_warps=4, num_stages=4),
  FlashAttentionConfig(64, 128, num_warps=4, num_stages=2),
)


def shared_memory_bytes(
  config: FlashAttentionConfig, head_dim: int, itemsize: int = 2, *, has_prefix: bool = False
) -> int:
  """Triton's shared memory for this kernel (the sm_90a compile agrees, see
  docs/perf/kernel_notes.md): the Q tile plus one K and one V tile per
  pipeline stage, and one stage more when prefix keys add a second
  pipelined loop."""
  stages = config.num_stages + (1 if has_prefix else 0)
  return itemsize * head_dim * (config.block_q + stages * 2 * config.block_k)


def choose_config(shapes: Mapping[str, Any]) -> FlashAttentionConfig:
  """Heuristic tiling.

  128-row query tiles are the FlashAttention-2 shape for Hopper-class tensor
  cores (the Q tile stays in registers, K/V tiles stream through a 3-stage
  pipeline). At D >= 128 the key step is 128 on 8 warps (tokamax's tuning of
  Pallas-Triton flash attention on H100 picks 128x128, 8 warps, 3 stages for
  non-causal d128; it compiles for sm_90a without spills and fits the shared
  memory); with prefix keys the second pipelined loop would not fit
  (`shared_memory_bytes`), so those keep 64-key steps. At D = 64 the key
  step is 64 on 4 warps. When 128-row tiles would leave fewer than two
  programs per SM (short query sequences, B=1), 64-row tiles double the
  grid. The longer key source (max of Nk and the prefix's Np) only caps
  `block_k` for tiny problems.
  """
  sizes = FlashAttentionSizes.of(shapes)
  programs_at_128 = sizes.batch * sizes.heads * cdiv(sizes.q_len, 128)
  block_q = 128 if programs_at_128 >= 2 * num_sms() else 64
  if block_q == 128 and sizes.head_dim >= 128:
    block_k = 64 if sizes.prefix_len else 128
    config = FlashAttentionConfig(128, block_k, num_warps=8, num_stages=3)
  elif block_q == 128:
    config = FlashAttentionConfig(128, 64, num_warps=4, num_stages=3)
  else:
    config = FlashAttentionConfig(64, 64, num_warps=4, num_stages=3)
  return _fit(config, sizes.q_len, sizes.longest_keys)


def candidate_configs(shapes: Mapping[str, Any]) -> list[FlashAttentionConfig]:
  """The sweep's configurations fitted to the problem, heuristic choice first,
  without duplicates, without those that spill or overflow shared memory on
  sm_90a at this head dim."""
  sizes = FlashAttentionSizes.of(shapes)
  has_prefix = sizes.prefix_len > 0
  excluded = set()
  if sizes.head_dim >= 128:
    excluded.update(_SPILL_AT_D128)
    if has_prefix:
      excluded.update(_SPILL_AT_D128_WITH_PREFIX)
  kept = [
    c
    for c in _SWEEP_CONFIGS
    if c not in excluded
    and shared_memory_bytes(c, sizes.head_dim, sizes.itemsize, has_prefix=has_prefix) <= SHARED_MEMORY_PER_BLOCK
  ]
  return fitted_candidates(choose_config(shapes), kept, lambda c: _fit(c, sizes.q_len, sizes.longest_keys))


def _flash_attention_kernel(
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
  o_ref,
  lse_ref,
  block_q: int,
  block_k: int,
  q_len: int,
  kv_len: int,
  prefix_len: int,
  window: Window | None,
  softcap: float | None,
):
  # scale [1] f32 (sm_scale); q [bq, D]; k, v [Nk, D]; optional: the prefix's
  # k, v [Np, D], key_valid [Nk] int8, segment_ids [Nq] int32, block_limits
  # [2] int32, a packed band's rows_lo, rows_hi [Nq] int32; out: o [bq, D]
  # and, when asked, lse [bq] f32 (base 2).
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
  has_segments, with_lse = segment_ids_ref is not None, lse_ref is not None
  logits = Logits.of(scale_ref[0], softcap)

  q_start = pl.program_id(0) * block_q
  ragged = q_len % block_q != 0
  q = load_rows(q_ref, 0, block_q, q_len - q_start, 0.0, ragged)
  q_segments = None
  if has_segments:
    q_segments = load_rows(keys.segment_ids, q_start, block_q, q_len, 0, ragged)
  band = None
  if window is not None:
    band = Band(window, q_len, kv_len, rows_lo_ref, rows_hi_ref).rows(q_start, block_q, block_k)

  def step(k, v, visible, carry):
    # `visible` None: every row sees the whole block (no mask, no empty rows).
    s, _ = logits.scores(jnp.dot(q, k.T, preferred_element_type=jnp.float32))
    return online_softmax_step(s, carry, v, visible=visible)

  o, m, l = walk_keys(step, init_carry(block_q, q_ref.shape[-1]), keys, q_segments, band)
  o = normalize(o, m, l)  # lonely rows (l == 0) output exactly 0
  store_rows(o_ref, o.astype(o_ref.dtype), q_len - q_start, ragged)
  if with_lse:  # What the backward recomputes the probabilities from.
    store_rows(lse_ref, lse_for_backward(m, l), q_len - q_start, ragged)


def _forward(
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
  *,
  config: FlashAttentionConfig,
  interpret: bool,
  with_lse: bool,
  window: Window | None = None,
  softcap: float | None = None,
):
  """One launch of the forward kernel (`config` fitted, `scale` `[1]` f32):
  `o`, and with `with_lse` also `lse [B, H, Nq]` (base 2, +inf for a
  lonely row). `window`: the band (`rows_lo`, `rows_hi` `[B, Nq]` when
  packed); `softcap`: the logit soft cap (`Logits`)."""
  batch, q_len, num_heads, head_dim = q.shape
  kv_len = k.shape[1]
  prefix_len = 0 if k_prefix is None else k_prefix.shape[1]
  block_q, block_k = config.block_q, config.block_k
  kv_head = kv_head_map(num_heads // k.shape[2])

  q_spec = pl.BlockSpec((None, block_q, None, head_dim), lambda i, b, h: (b, i, h, 0))
  # K/V blocks span the whole sequence of one (batch row, head); the kernel
  # slices them with masked loads, so their length need not be a power of two.
  # Grouped query heads read their group's K/V (never copied per head).
  kv_spec = pl.BlockSpec((None, kv_len, None, head_dim), lambda i, b, h: (b, 0, kv_head(h), 0))
  prefix_spec = pl.BlockSpec((None, prefix_len, None, head_dim), lambda i, b, h: (b, 0, kv_head(h), 0))
  limits = None
  if key_valid is not None or segment_ids is not None:
    limits = key_block_limits(
      key_valid, segment_ids, batch=batch, q_len=q_len, kv_len=kv_len, block_q=block_q, block_k=block_k
    )
  rows_spec = pl.BlockSpec((None, q_len), lambda i, b, h: (b, 0))
  inputs = {
    "scale": (scale, pl.BlockSpec((1,), lambda i, b, h: (0,))),
    "q": (q, q_spec),
    "k": (k, kv_spec),
    "v": (v, kv_spec),
    "k_prefix": (k_prefix if prefix_len else None, prefix_spec),
    "v_prefix": (v_prefix if prefix_len else None, prefix_spec),
    "key_valid": (
      None if key_valid is None else key_valid.astype(jnp.int8),
      pl.BlockSpec((None, kv_len), lambda i, b, h: (b, 0)),
    ),
    "segment_ids": (None if segment_ids is None else segment_ids.astype(jnp.int32), rows_spec),
    "block_limits": (limits, pl.BlockSpec((None, None, 2), lambda i, b, h: (b, i, 0))),
    "rows_lo": (rows_lo, rows_spec),
    "rows_hi": (rows_hi, rows_spec),
  }
  outputs = {
    "o": (jax.ShapeDtypeStruct(q.shape, q.dtype), q_spec),
    "lse": (
      jax.ShapeDtypeStruct((batch, num_heads, q_len), jnp.float32) if with_lse else None,
      pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i)),
    ),
  }
  kernel = functools.partial(
    _flash_attention_kernel,
    block_q=block_q,
    block_k=block_k,
    q_len=q_len,
    kv_len=kv_len,
    prefix_len=prefix_len,
    window=window,
    softcap=softcap,
  )
  outs = common.named_pallas_call(
    kernel,
    inputs=inputs,
    outputs=outputs,
    grid=(cdiv(q_len, block_q), batch, num_heads),
    compiler_params=common.compiler_params(config),
    interpret=interpret,
    name="flash_attention",
  )
  return (outs["o"], outs["lse"]) if with_lse else outs["o"]


class _Static(NamedTuple):
  config: FlashAttentionConfig  # fitted
  backward_config: FlashAttentionBwdConfig  # fitted
  interpret: bool
  window: Window | None = None
  softcap: float | None = None
  with_lse: bool = False  # the primal returns (o, lse) (lse base 2)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Needed:
  """Which gradients the backward pass makes (residual metadata, no leaves)."""

  dq: bool
  dkv: bool
  dprefix: bool
  dscale: bool


def _launch_forward(args, static: _Static, with_lse: bool):
  return _forward(
    *args,
    config=static.config,
    interpret=static.interpret,
    with_lse=with_lse,
    window=static.window,
    softcap=static.softcap,
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(10,))
def _attention(q, k, v, k_prefix, v_prefix, key_valid, segment_ids, rows_lo, rows_hi, scale, static: _Static):
  args = (q, k, v, k_prefix, v_prefix, key_valid, segment_ids, rows_lo, rows_hi, scale)
  return _launch_forward(args, static, static.with_lse)


def _attention_fwd(q, k, v, k_prefix, v_prefix, key_valid, segment_ids, rows_lo, rows_hi, scale, static: _Static):
  # symbolic_zeros: each array arrives with `.perturbed`, so the backward
  # launches only the kernels whose gradients are needed.
  args = (q, k, v, k_prefix, v_prefix, key_valid, segment_ids, rows_lo, rows_hi, scale)
  perturbed = lambda x: x is not None and x.perturbed  # noqa: E731
  needed = _Needed(
    dq=perturbed(q),
    dkv=perturbed(k) or perturbed(v),
    dprefix=perturbed(k_prefix) or perturbed(v_prefix),
    dscale=perturbed(scale),
  )
  args = [None if x is None else x.value for x in args]
  o, lse = _launch_forward(args, static, True)
  return ((o, lse) if static.with_lse else o), (*args, o, lse, needed)


def _attention_bwd(static: _Static, residuals, cotangent):
  q, k, v, k_prefix, v_prefix, key_valid, segment_ids, rows_lo, rows_hi, scale, o, lse, needed = residuals
  do, dlse = cotangent if static.with_lse else (cotangent, None)
  if isinstance(do, SymbolicZero):
    do = jnp.zeros(o.shape, o.dtype)
  if isinstance(dlse, SymbolicZero):
    dlse = None
  g = attention_backward(
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
    dlse=dlse,
    window=static.window,
    softcap=static.softcap,
    config=static.backward_config,
    interpret=static.interpret,
    need_dq=needed.dq,
    need_dkv=needed.dkv,
    need_dprefix=needed.dprefix,
    need_dscale=needed.dscale,
  )
  return g.dq, g.dk, g.dv, g.dk_prefix, g.dv_prefix, None, None, None, None, g.dscale


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


@functools.partial(
  jax.jit, static_argnames=("causal", "window", "softcap", "return_lse", "config", "backward_config", "interpret")
)
def flash_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  key_valid: jax.Array | None = None,
  k_prefix: jax.Array | None = None,
  v_prefix: jax.Array | None = None,
  segment_ids: jax.Array | None = None,
  sm_scale: float | jax.Array | None = None,
  causal: bool = False,
  window: tuple[int | None, int | None] | None = None,
  softcap: float | None = None,
  cu_seqlens_q: jax.Array | None = None,
  cu_seqlens_k: jax.Array | None = None,
  return_lse: bool = False,
  config: FlashAttentionConfig | None = None,
  backward_config: FlashAttentionBwdConfig | None = None,
  interpret: bool | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Softmax attention `softmax(q k^T * sm_scale) v` over the visible keys.

  Args:
    q: `[B, Nq, H, D]`; `D` a power of two >= 16.
    k, v: `[B, Nk, Hkv, D]`, same dtype as `q`; Hkv divides H, query head
      h reads key/value head `h // (H / Hkv)` (grouped-query and
      multi-query attention: the group shares K/V through the index maps,
      never copied per head).
    key_valid: optional `[B, Nk]` bool; False hides key j of batch row b.
      Whatever a hidden key or value holds (NaN, Inf) reaches neither the
      output nor a gradient.
    k_prefix, v_prefix: optional `[B, Np, Hkv, D]`; keys become
      `concat(k_prefix, k)`, every prefix key visible to every query.
      `Np = 0` is the same as no prefix. Not with `causal` or `window`.
    segment_ids: optional `[B, Nq]` int32 (requires `Nk == Nq`: queries and
      keys are the same tokens); key j visible to query i iff
      `segment_ids[j] <= segment_ids[i]`. Exact for any ids; key blocks are
      skipped when the ids are nondecreasing. (A NaN in a key that some
      query sees reaches every row of its head through the value product.)
    sm_scale: a float or a traced scalar; defaults to `D ** -0.5`.
    causal: query i sees keys `j <= i + Nk - Nq` (bottom-right aligned, as
      FlashAttention-2 and cuDNN; per sequence when packed).
    window: `(left, right)`, None or ints >= 0 (None: unbounded side):
      query i sees keys `i' - left <= j <= i' + right`, `i' = i + Nk - Nq`;
      with `causal` the right side is 0. Key blocks outside every row's
      band are neither loaded nor computed.
    softcap: scores become `softcap * tanh(s / softcap)` (s the scaled
      score) before masks and softmax (`keys.Logits`).
    cu_seqlens_q, cu_seqlens_k: packed sequences (varlen): q `[T, H, D]`,
      k and v `[Tk, Hkv, D]`, key_valid `[Tk]`, and these `[S + 1]` int32;
      sequence s is queries `[cu_seqlens_q[s], cu_seqlens_q[s+1])` over keys
      `[cu_seqlens_k[s], cu_seqlens_k[s+1])` (`keys.packed_intervals`).
    return_lse: also return lse `[B, H, Nq]` (packed: `[H, T]`) f32, the
      natural-log sum of exp of each row's visible scores, +inf for a row
      that sees no key.
    config: tiling; None = `choose_config`. Blocks larger than the problem
      are shrunk to it.
    backward_config: tiling of the backward kernels; None =
      `choose_backward_config`.
    interpret: None = interpret when no GPU is present.

  Any B, Nq, Nk, Np >= 0 (no query: an empty result; no key: zeros).
  Differentiable (`jax.custom_vjp`, FlashAttention-2 backward kernels,
  `flash_attention_bwd`) in q, k, v, the prefix, `sm_scale` and the lse
  output; hidden keys get exactly zero gradients, grouped K/V the sum over
  their query heads.

  Returns:
    `[B, Nq, H, D]` in `q.dtype` (packed: `[T, H, D]`); rows that see no
    key are 0. With `return_lse`, `(o, lse)`.
  """
  q, k, v, k_prefix, v_prefix, key_valid, packed = checked_operands(
    q,
    k,
    v,
    key_valid=key_valid,
    k_prefix=k_prefix,
    v_prefix=v_prefix,
    segment_ids=segment_ids,
    causal=causal,
    window=window,
    softcap=softcap,
    cu_seqlens_q=cu_seqlens_q,
    cu_seqlens_k=cu_seqlens_k,
  )
  batch, q_len, num_heads, head_dim = q.shape
  check_pow2_dim("head dim D", head_dim)
  if sm_scale is not None and jnp.ndim(sm_scale) != 0:
    raise ValueError(f"sm_scale must be a scalar, got shape {jnp.shape(sm_scale)}")
  finish = functools.partial(packed_outputs, packed=packed, return_lse=return_lse)
  kv_len = k.shape[1]
  prefix_len = 0 if k_prefix is None else k_prefix.shape[1]
  if not (batch and q_len and kv_len):
    return finish(jnp.zeros(q.shape, q.dtype), jnp.full((batch, num_heads, q_len), jnp.inf, jnp.float32))
  scale = jnp.asarray(head_dim**-0.5 if sm_scale is None else sm_scale, jnp.float32).reshape(1)
  band = band_window(causal, window, packed)
  rows_lo = rows_hi = None
  if packed:
    assert band is not None and cu_seqlens_q is not None and cu_seqlens_k is not None
    lo, hi = packed_intervals(cu_seqlens_q, cu_seqlens_k, band, q_len=q_len, kv_len=kv_len)
    rows_lo, rows_hi = lo[None], hi[None]
  if config is None:
    config = choose_config({"q": q, "k": k, "k_prefix": k_prefix})
  longest = max(kv_len, prefix_len)
  backward_config = backward_config_for(
    backward_config, batch=batch, heads=num_heads, q_len=q_len, kv_len=longest, head_dim=head_dim
  )
  static = _Static(
    _fit(config, q_len, longest),
    backward_config,
    resolve_interpret(interpret),
    band,
    None if softcap is None else float(softcap),
    return_lse,
  )
  out = _attention(q, k, v, k_prefix, v_prefix, key_valid, segment_ids, rows_lo, rows_hi, scale, static)
  return finish(*out) if return_lse else finish(out, None)
