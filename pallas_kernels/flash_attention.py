"""Flash attention (forward) on the Pallas Triton lowering.

One kernel serves three attention shapes through masks and key sources:

* dense non-causal attention, optionally with a per-key visibility mask
  (`key_valid [B, Nk]`: text cross-attention pads its keys);
* prefix-cached attention: the keys are `concat(k_prefix, k)` along the
  sequence, read from the two tensors in turn, never concatenated in HBM;
* block-causal attention over segments: `segment_ids [B, N]` on tokens that are
  both the queries and the keys; key j is visible to query i iff
  `segment_ids[j] <= segment_ids[i]`.

Layout is `[B, N, H, D]` (heads not transposed in HBM). A program owns
`block_q` query rows of one (batch row, head) and walks the keys in `block_k`
steps with the online softmax of FlashAttention-2, in fp32 and base 2 (the
scale is folded into one multiply by `sm_scale * log2(e)`). The probabilities
are rounded to the value dtype for the second dot, as every flash kernel does;
the output is rounded once at the end.

Key blocks are visited in two loops: the leading blocks every query row of the
program sees are processed without any mask; the remaining blocks, up to the
last one some row sees, apply bounds, `key_valid` and segment masks. Blocks
past that are skipped. With masks present, the two limits come from a small
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
from typing import Any, Mapping, NamedTuple

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from pallas_kernels import common
import jax.numpy as jnp

from pallas_kernels.common import cdiv, check_pow2_dim, fit_block, fitted_candidates, resolve_interpret
from pallas_kernels.config_rules import DOT_BLOCK, NUM_STAGES, NUM_WARPS, KernelConfig, field
from pallas_kernels.device import SHARED_MEMORY_PER_BLOCK, num_sms
from pallas_kernels.online_softmax import LOG2_E, init_carry, normalize, online_softmax_step

# Padded key rows get this segment id so that no query sees them.
_INVISIBLE_SEGMENT = jnp.iinfo(jnp.int32).max


@dataclasses.dataclass(frozen=True)
class FlashAttentionConfig(KernelConfig):
  """Tiling of the forward kernel: `block_q` query rows per program, keys
  walked `block_k` at a time."""
  block_q: int = field(128, DOT_BLOCK)
  block_k: int = field(64, DOT_BLOCK)
  num_warps: int = field(8, NUM_WARPS)
  num_stages: int = field(3, NUM_STAGES)


class FlashAttentionSizes(NamedTuple):
  """Problem sizes of the inputs' shapes (input name -> array or
  ShapeDtypeStruct; `k_prefix` may be absent or None)."""
  batch: int
  heads: int
  q_len: int
  kv_len: int
  prefix_len: int   # 0 without prefix keys
  head_dim: int
  itemsize: int     # bytes per q/k/v element

  @classmethod
  def of(cls, shapes: Mapping[str, Any]) -> FlashAttentionSizes:
    batch, q_len, heads, head_dim = shapes["q"].shape
    prefix = shapes.get("k_prefix")
    prefix_len = 0 if prefix is None else prefix.shape[1]
    return cls(int(batch), int(heads), int(q_len), int(shapes["k"].shape[1]), int(prefix_len),
               int(head_dim), jnp.dtype(shapes["q"].dtype).itemsize)

  @property
  def longest_keys(self) -> int:
    """The longer key source (Nk or Np): what caps `block_k`."""
    return max(self.kv_len, self.prefix_len)


def _fit(config: FlashAttentionConfig, q_len: int, kv_len: int) -> FlashAttentionConfig:
  """Shrinks the blocks of `config` to the problem (tiny Nq or Nk)."""
  return dataclasses.replace(
      config, block_q=fit_block(config.block_q, q_len),
      block_k=fit_block(config.block_k, kv_len))


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
_SPILL_AT_D128_WITH_PREFIX = (FlashAttentionConfig(128, 32, num_warps=4, num_stages=4),
                              FlashAttentionConfig(64, 128, num_warps=4, num_stages=2))


def shared_memory_bytes(config: FlashAttentionConfig, head_dim: int, itemsize: int = 2, *,
                        has_prefix: bool = False) -> int:
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
  kept = [c for c in _SWEEP_CONFIGS
          if c not in excluded and shared_memory_bytes(
              c, sizes.head_dim, sizes.itemsize, has_prefix=has_prefix) <= SHARED_MEMORY_PER_BLOCK]
  return fitted_candidates(choose_config(shapes), kept, lambda c: _fit(c, sizes.q_len, sizes.longest_keys))


def _flash_attention_kernel(*refs, has_prefix: bool, has_key_valid: bool,
                            has_segments: bool, has_block_limits: bool,
                            qk_scale: float, block_q: int, block_k: int,
                            q_len: int, kv_len: int, prefix_len: int):
  refs = iter(refs)
  q_ref, k_ref, v_ref = next(refs), next(refs), next(refs)  # [bq, D], [Nk, D]
  k_prefix_ref, v_prefix_ref = (next(refs), next(refs)) if has_prefix else (None, None)
  key_valid_ref = next(refs) if has_key_valid else None      # [Nk] int8
  segment_ids_ref = next(refs) if has_segments else None     # [Nq] int32
  block_limits_ref = next(refs) if has_block_limits else None  # [2] int32
  o_ref = next(refs)                                         # [bq, D]
  head_dim = q_ref.shape[-1]

  q_start = pl.program_id(0) * block_q
  q_rows_valid = q_start + jnp.arange(block_q) < q_len
  if q_len % block_q:
    q = plgpu.load(q_ref, mask=q_rows_valid[:, None], other=0.0)
  else:
    q = q_ref[...]

  def step(k, v, visible, carry):
    # `visible` None: every row sees the whole block (no mask, no empty rows).
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * qk_scale
    return online_softmax_step(s, carry, v, visible=visible)

  carry = init_carry(block_q, head_dim)

  def unmasked_body(kk_ref, vv_ref):
    def body(block, carry):
      keys = pl.ds(block * block_k, block_k)
      return step(kk_ref[keys, :], vv_ref[keys, :], None, carry)
    return body

  def load_key_block(kk_ref, vv_ref, start, length):
    in_bounds = start + jnp.arange(block_k) < length
    keys = pl.ds(start, block_k)
    k = plgpu.load(kk_ref.at[keys, :], mask=in_bounds[:, None], other=0.0)
    # Zeros, not garbage: a 0 probability times a NaN value would be NaN.
    v = plgpu.load(vv_ref.at[keys, :], mask=in_bounds[:, None], other=0.0)
    return k, v, in_bounds

  # Prefix keys: visible to every query; only the ragged last block is masked.
  # (Edge blocks run as loops with a traced index: their slices may extend
  # past the ref, which a static index would reject; the mask covers it.)
  if has_prefix:
    if prefix_len >= block_k:
      carry = lax.fori_loop(0, prefix_len // block_k,
                            unmasked_body(k_prefix_ref, v_prefix_ref), carry)

    def prefix_edge_body(block, carry):
      k, v, in_bounds = load_key_block(k_prefix_ref, v_prefix_ref, block * block_k, prefix_len)
      return step(k, v, in_bounds[None, :], carry)

    carry = lax.fori_loop(prefix_len // block_k, cdiv(prefix_len, block_k),
                          prefix_edge_body, carry)

  # Main keys: blocks [0, n_unmasked) are seen whole by every row of this
  # program; blocks [n_unmasked, n_blocks) are masked; the rest are skipped.
  if has_block_limits:
    n_unmasked, n_blocks = block_limits_ref[0], block_limits_ref[1]
  else:
    n_unmasked, n_blocks = kv_len // block_k, cdiv(kv_len, block_k)

  if has_segments:
    q_segments = plgpu.load(segment_ids_ref.at[pl.ds(q_start, block_q)],
                            mask=q_rows_valid, other=0)

  def masked_body(block, carry):
    k_start = block * block_k
    k, v, in_bounds = load_key_block(k_ref, v_ref, k_start, kv_len)
    keys = pl.ds(k_start, block_k)
    visible = in_bounds
    if has_key_valid:
      visible &= plgpu.load(key_valid_ref.at[keys], mask=in_bounds, other=0) != 0
    visible = visible[None, :]
    if has_segments:
      k_segments = plgpu.load(segment_ids_ref.at[keys], mask=in_bounds,
                              other=_INVISIBLE_SEGMENT)
      visible = visible & (k_segments[None, :] <= q_segments[:, None])
    return step(k, v, visible, carry)

  if kv_len >= block_k:  # Otherwise no whole block exists (n_unmasked = 0).
    carry = lax.fori_loop(0, n_unmasked, unmasked_body(k_ref, v_ref), carry)
  o, m, l = lax.fori_loop(n_unmasked, n_blocks, masked_body, carry)
  o = normalize(o, m, l)  # lonely rows (l == 0) output exactly 0
  if q_len % block_q:
    plgpu.store(o_ref, o.astype(o_ref.dtype), mask=q_rows_valid[:, None])
  else:
    o_ref[...] = o.astype(o_ref.dtype)


def key_block_limits(key_valid: jax.Array | None, segment_ids: jax.Array | None,
                     *, batch: int, q_len: int, kv_len: int, block_q: int,
                     block_k: int) -> jax.Array:
  """Per (batch row, query block): `[n_unmasked, n_blocks]` key blocks.

  Keys `[0, full)` are visible to every query row of the block and keys from
  `end` on to none of them; `n_unmasked = full // block_k` and
  `n_blocks = cdiv(end, block_k)`. Exact for any mask, tight for the recorded
  ones (a valid prefix of padded text keys, nondecreasing segment ids).
  Returns int32 `[B, cdiv(q_len, block_q), 2]`.
  """
  num_q_blocks = cdiv(q_len, block_q)
  full = jnp.full((batch, num_q_blocks), kv_len, jnp.int32)
  end = jnp.full((batch, num_q_blocks), kv_len, jnp.int32)
  if key_valid is not None:
    valid = key_valid.astype(bool)
    first_invalid = jnp.where(jnp.all(valid, axis=1), kv_len, jnp.argmin(valid, axis=1))
    last_valid_end = jnp.where(jnp.any(valid, axis=1),
                               kv_len - jnp.argmax(valid[:, ::-1], axis=1), 0)
    full = jnp.minimum(full, first_invalid.astype(jnp.int32)[:, None])
    end = jnp.minimum(end, last_valid_end.astype(jnp.int32)[:, None])
  if segment_ids is not None:
    seg = segment_ids.astype(jnp.int32)
    # Per query block: the smallest and largest segment among its valid rows
    # (edge padding repeats the last row).
    padded = jnp.pad(seg, ((0, 0), (0, num_q_blocks * block_q - q_len)), mode="edge")
    blocks = padded.reshape(batch, num_q_blocks, block_q)
    seg_lo, seg_hi = blocks.min(axis=2), blocks.max(axis=2)
    # Key j is visible to all rows iff seg[j] <= seg_lo; the leading run of
    # such keys ends where the running max first exceeds seg_lo. The last key
    # some row sees is the last j with seg[j] <= seg_hi, found on the suffix
    # minimum. Both helper sequences are nondecreasing.
    running_max = lax.cummax(seg, axis=1)
    suffix_min = lax.cummin(seg, axis=1, reverse=True)
    # Searching a nondecreasing sequence (side="right") is counting the
    # entries <= the value: one fused compare-and-sum per (batch row, query
    # block), where jnp.searchsorted lowers to a while loop before the launch.
    def count_le(sorted_seq, values):  # [B, N], [B, Q] -> [B, Q]
      return jnp.sum(sorted_seq[:, None, :] <= values[:, :, None], axis=2, dtype=jnp.int32)
    full = jnp.minimum(full, count_le(running_max, seg_lo))
    end = jnp.minimum(end, count_le(suffix_min, seg_hi))
  n_blocks = (end + block_k - 1) // block_k
  n_unmasked = jnp.minimum(full // block_k, n_blocks)
  return jnp.stack([n_unmasked, n_blocks], axis=-1)


@functools.partial(jax.jit, static_argnames=("sm_scale", "config", "interpret"))
def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    key_valid: jax.Array | None = None,
    k_prefix: jax.Array | None = None,
    v_prefix: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    sm_scale: float | None = None,
    config: FlashAttentionConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
  """Softmax attention `softmax(q k^T * sm_scale) v` over the visible keys.

  Args:
    q: `[B, Nq, H, D]`; `D` a power of two >= 16.
    k, v: `[B, Nk, H, D]`, same dtype as `q`.
    key_valid: optional `[B, Nk]` bool; False hides key j of batch row b.
    k_prefix, v_prefix: optional `[B, Np, H, D]`; keys become
      `concat(k_prefix, k)`, every prefix key visible to every query.
      `Np = 0` is the same as no prefix.
    segment_ids: optional `[B, Nq]` int32 (requires `Nk == Nq`: queries and
      keys are the same tokens); key j visible to query i iff
      `segment_ids[j] <= segment_ids[i]`. Exact for any ids; key blocks are
      skipped when the ids are nondecreasing.
    sm_scale: defaults to `D ** -0.5`.
    config: tiling; None = `choose_config`. Blocks larger than the problem
      are shrunk to it.
    interpret: None = interpret when no GPU is present.

  Returns:
    `[B, Nq, H, D]` in `q.dtype`; rows that see no key are 0.
  """
  batch, q_len, num_heads, head_dim = q.shape
  kv_len = k.shape[1]
  if k.shape != (batch, kv_len, num_heads, head_dim) or v.shape != k.shape:
    raise ValueError(f"k {k.shape} / v {v.shape} do not match q {q.shape}")
  if not (k.dtype == v.dtype == q.dtype):
    raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
  check_pow2_dim("head dim D", head_dim)
  if q_len < 1 or kv_len < 1:
    raise ValueError(f"empty sequence: Nq={q_len}, Nk={kv_len}")
  if (k_prefix is None) != (v_prefix is None):
    raise ValueError("k_prefix and v_prefix go together")
  prefix_len = 0 if k_prefix is None else k_prefix.shape[1]
  has_prefix = prefix_len > 0
  if has_prefix:
    expected = (batch, prefix_len, num_heads, head_dim)
    if k_prefix.shape != expected or v_prefix.shape != expected:
      raise ValueError(f"prefix shapes {k_prefix.shape}/{v_prefix.shape} != {expected}")
    if not (k_prefix.dtype == v_prefix.dtype == q.dtype):
      raise ValueError("prefix dtype differs from q")
  if key_valid is not None and key_valid.shape != (batch, kv_len):
    raise ValueError(f"key_valid {key_valid.shape} != {(batch, kv_len)}")
  if segment_ids is not None:
    if kv_len != q_len or segment_ids.shape != (batch, q_len):
      raise ValueError(f"segment_ids {segment_ids.shape} need Nk == Nq == {q_len}")

  if sm_scale is None:
    sm_scale = head_dim ** -0.5
  if config is None:
    config = choose_config({"q": q, "k": k, "k_prefix": k_prefix})
  config = _fit(config, q_len, max(kv_len, prefix_len))
  block_q, block_k = config.block_q, config.block_k
  num_q_blocks = cdiv(q_len, block_q)

  q_spec = pl.BlockSpec((None, block_q, None, head_dim), lambda i, b, h: (b, i, h, 0))
  # K/V blocks span the whole sequence of one (batch row, head); the kernel
  # slices them with masked loads, so their length need not be a power of two.
  kv_spec = pl.BlockSpec((None, kv_len, None, head_dim), lambda i, b, h: (b, 0, h, 0))
  inputs, in_specs = [q, k, v], [q_spec, kv_spec, kv_spec]
  if has_prefix:
    prefix_spec = pl.BlockSpec((None, prefix_len, None, head_dim),
                               lambda i, b, h: (b, 0, h, 0))
    inputs += [k_prefix, v_prefix]
    in_specs += [prefix_spec, prefix_spec]
  if key_valid is not None:
    inputs.append(key_valid.astype(jnp.int8))
    in_specs.append(pl.BlockSpec((None, kv_len), lambda i, b, h: (b, 0)))
  if segment_ids is not None:
    inputs.append(segment_ids.astype(jnp.int32))
    in_specs.append(pl.BlockSpec((None, q_len), lambda i, b, h: (b, 0)))
  has_block_limits = key_valid is not None or segment_ids is not None
  if has_block_limits:
    inputs.append(key_block_limits(key_valid, segment_ids, batch=batch, q_len=q_len,
                                   kv_len=kv_len, block_q=block_q, block_k=block_k))
    in_specs.append(pl.BlockSpec((None, None, 2), lambda i, b, h: (b, i, 0)))

  kernel = functools.partial(
      _flash_attention_kernel, has_prefix=has_prefix,
      has_key_valid=key_valid is not None, has_segments=segment_ids is not None,
      has_block_limits=has_block_limits, qk_scale=float(sm_scale) * LOG2_E,
      block_q=block_q, block_k=block_k, q_len=q_len, kv_len=kv_len,
      prefix_len=prefix_len)
  return common.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      grid=(num_q_blocks, batch, num_heads),
      in_specs=in_specs,
      out_specs=q_spec,
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      interpret=resolve_interpret(interpret),
      name="flash_attention",
  )(*inputs)

