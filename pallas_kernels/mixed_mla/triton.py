"""Mixed FP8/FP4 MLA decode (DeepSeek-V4.1, SPEC 4.10) on the Pallas Triton lowering.

One query token per sequence, 64 heads sharing one latent KV head (D = 512,
used as key and value). Its keys are the union of two paged byte caches,
dequantized inside the kernel:

* FP8 window cache `kv_fp8 [N8, P8, 1, D + 4*D/128]` (528-byte records: D
  e4m3 bytes, then D/128 little-endian f32 scales, one per 128 dims), read at
  the flat rows `indices_fp8 [B, K8]` (`page * P8 + offset`);
* FP4 compressed cache `kv_fp4 [N4, P4, 1, D/2 + D/16]` (288-byte records: D/2
  bytes of packed e2m1, low nibble = even dim, then D/16 UE8M0 scales, one
  per 16 dims), read at `indices_fp4 [B, K4]`.

An index is invalid when negative or past the cache's rows. One softmax over
both sets: `P = q.k * sm_scale`; `lse = logsumexp(P)` (natural log, without
the sink); `out = sum exp(P) k / (sum exp(P) + exp(attn_sink[h]))`. A row with
no valid index gives `out = 0`, `lse = +inf`.

Two stages, each its own `pallas_call` and its own part of
`MixedMlaDecodeConfig`: the split stage (`_split_kernel`, grid `(B, splits,
H / block_h * D / block_d)`: one split of one sequence's window or
compressed slots for `block_h` heads and `block_d` output columns, partial
outputs and base-2 lse in fp32) and the combine (`split_kv.combine_splits`:
the sink in the denominator, the bf16 rounding). How it tiles, dequantizes
and keeps precision, and what it measures: `docs/perf/kernel_notes.md`
("Mixed MLA decode").

Limits: H a multiple of `block_h` (>= 16), D a multiple of 128, q bf16;
B = 0 and K8 / K4 = 0 are fine.
(Whole engine pools work: the Triton lowering switches to 64-bit offsets for
arrays over 4 GiB.)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.mixed_mla.caches import FP4_GROUP, MixedMlaSizes, check_inputs, nonempty
from pallas_kernels.mixed_mla.config import CHUNK, HALF, MixedMlaDecodeConfig, MixedMlaSplitStage
from pallas_kernels.shared import common, fp_formats
from pallas_kernels.shared.common import MIN_DOT_DIM, cdiv, resolve_interpret
from pallas_kernels.shared.device import num_sms
from pallas_kernels.shared.online_softmax import LOG2_E, init_carry, lse_base2, normalize, online_softmax_step
from pallas_kernels.shared.split_kv import CombineStage, choose_combine, combine_splits, fit_combine


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Static problem facts the kernels need."""

  head_dim: int
  k8: int
  k4: int
  rows8: int
  rows4: int
  keys8: int  # slots per FP8 split (keys_per_split, capped to K8 rounded up)
  keys4: int
  splits8: int
  splits4: int
  block_d: int  # output columns per program

  @property
  def splits(self) -> int:
    return self.splits8 + self.splits4

  @property
  def column_blocks(self) -> int:
    return self.head_dim // self.block_d


def _layout(head_dim, k8, k4, rows8, rows4, split: MixedMlaSplitStage) -> _Layout:
  def keys(k):
    return min(split.keys_per_split, cdiv(k, split.block_k) * split.block_k)

  keys8, keys4 = keys(k8), keys(k4)
  return _Layout(
    head_dim,
    k8,
    k4,
    rows8,
    rows4,
    keys8,
    keys4,
    cdiv(k8, keys8) if k8 else 0,
    cdiv(k4, keys4) if k4 else 0,
    split.block_d,
  )


def _fit_block_d(block_d: int, head_dim: int) -> int:
  """The largest power of two <= block_d dividing D (D a multiple of 128)."""
  block_d = min(block_d, head_dim)
  while head_dim % block_d:
    block_d //= 2
  return block_d


def _fit(config: MixedMlaDecodeConfig, sizes: MixedMlaSizes) -> MixedMlaDecodeConfig:
  """Caps the head and column blocks to the problem and raises the key step
  to a dot dimension; the combine's blocks divide H and D."""
  block_k = max(config.split.block_k, MIN_DOT_DIM)
  split = dataclasses.replace(
    config.split,
    block_h=min(config.split.block_h, max(sizes.heads, MIN_DOT_DIM)),
    block_k=block_k,
    keys_per_split=max(config.split.keys_per_split, block_k),
    block_d=_fit_block_d(config.split.block_d, sizes.head_dim),
  )
  lay = _layout(sizes.head_dim, sizes.k8, sizes.k4, 1, 1, split)
  return MixedMlaDecodeConfig(
    split=split, combine=fit_combine(config.combine, sizes.heads, sizes.head_dim, max(lay.splits, 1))
  )


def _split_programs(sizes: MixedMlaSizes, split: MixedMlaSplitStage) -> int:
  lay = _layout(sizes.head_dim, sizes.k8, sizes.k4, 1, 1, split)
  return sizes.batch * lay.splits * cdiv(sizes.heads, split.block_h) * lay.column_blocks


# The split tilings the heuristic tries in order, (keys_per_split,
# block_d): the fewest partials and the least recomputation of scores
# first. On sm_90a (8 warps, 32-key steps) whole rows and 256-column blocks
# take 255 registers (1 CTA per SM), 128-column blocks of 64-slot splits
# 128 (2 CTAs per SM), all without spills; 128-slot splits of 128 columns
# spill (24 bytes) and are left out.
_SPLIT_TRIES = ((128, 512), (64, 256), (64, 128))


def choose_config(shapes: Mapping[str, Any]) -> MixedMlaDecodeConfig:
  """Heuristic: 16 heads per program (the smallest dot tile) and 32-key
  steps with 8 warps (a 32 x 512 bf16 dequantized key tile), and the first
  of `_SPLIT_TRIES` that gives a program per SM: B = 1: 64-slot splits of
  128 columns, 10 x 4 x 4 = 160 programs, 1.25 MiB of partials; B = 2-6:
  64-slot splits of 256 columns (160-480 programs); B >= 7: 128-slot splits
  of whole rows (5 x 4 x B programs).
  The combine: `split_kv.choose_combine` for a program per SM too (B = 1:
  4 heads x 32 columns, 256 programs)."""
  sizes = MixedMlaSizes.of(shapes)
  for keys_per_split, block_d in _SPLIT_TRIES:
    split = MixedMlaSplitStage(
      block_h=16, block_k=32, keys_per_split=keys_per_split, num_warps=8, num_stages=2, block_d=block_d
    )
    split = _fit(MixedMlaDecodeConfig(split=split), sizes).split
    if _split_programs(sizes, split) >= num_sms():
      break
  lay = _layout(sizes.head_dim, sizes.k8, sizes.k4, 1, 1, split)
  combine = choose_combine(sizes.batch, sizes.heads, sizes.head_dim, max(lay.splits, 1), num_sms())
  return _fit(MixedMlaDecodeConfig(split=split, combine=combine), sizes)


def candidate_configs(shapes: Mapping[str, Any]) -> list[MixedMlaDecodeConfig]:
  """What a sweep explores, heuristic first, without duplicates: split
  tilings that compile without spills on sm_90a (64-head blocks, 64-key
  steps, 16-key steps over whole rows, 32-head blocks of 32-key steps and
  128-slot splits of 128 columns spill and are left out), then other
  combine tiles."""
  sizes = MixedMlaSizes.of(shapes)
  chosen = choose_config(shapes)
  combine = chosen.combine
  configs = [chosen]
  for block_h, block_k, keys_per_split, block_d, num_warps in (
    (16, 32, 64, 128, 8),
    (16, 32, 64, 256, 8),
    (16, 32, 128, 512, 8),
    (16, 32, 64, 512, 8),
    (16, 32, 32, 512, 8),
    (16, 32, 128, 64, 8),
    (32, 16, 128, 256, 8),
  ):
    split = MixedMlaSplitStage(block_h, block_k, keys_per_split, num_warps=num_warps, num_stages=2, block_d=block_d)
    configs.append(MixedMlaDecodeConfig(split=split, combine=combine))
  for block_h, block_d in ((16, 64), (16, 128), (8, 32)):
    configs.append(MixedMlaDecodeConfig(split=chosen.split, combine=CombineStage(block_h, block_d)))
  return list(dict.fromkeys(_fit(c, sizes) for c in configs))


# ---------------------------------------------------------------------------
# Stage 1: split.


def _load_rows(idx_ref, start, *, block_k: int, num_slots: int, num_rows: int, masked: bool):
  """Indices of slots [start, start + block_k): (rows clamped to 0 where
  invalid, valid)."""
  if masked:
    slots = start + jnp.arange(block_k)
    idx = plgpu.load(idx_ref.at[pl.ds(start, block_k)], mask=slots < num_slots, other=-1)
  else:
    idx = idx_ref[pl.ds(start, block_k)]
  valid = (idx >= 0) & (idx < num_rows)
  return jnp.where(valid, idx, 0), valid


def _part_columns(part):
  """The 64 dims of value part `part` (static or traced): chunk `part // 2`,
  its even (`part % 2 == 0`) or odd dims."""
  return pl.ds(CHUNK * (part // 2) + part % 2, HALF, stride=2)


def _fp8_scale(kv_ref, rows, valid, head_dim, chunk):
  """The f32 scale of 128-dim chunk `chunk` of each gathered FP8 record
  (four single-byte columns, little-endian, assembled with shifts); 0 for
  invalid slots."""
  word = jnp.zeros(rows.shape, jnp.uint32)
  for j in range(4):
    byte = kv_ref[rows, head_dim + 4 * chunk + j]
    word = word | (byte.astype(jnp.uint32) << (8 * j))
  return jnp.where(valid, lax.bitcast_convert_type(word, jnp.float32), 0.0)


def _fp8_values(raw, valid):
  """e4m3 bytes `[bk, 64]` -> bf16 (exact), invalid slots selected to 0."""
  values = lax.bitcast_convert_type(raw, jnp.float8_e4m3fn).astype(jnp.bfloat16)
  return jnp.where(valid[:, None], values, 0.0).astype(jnp.bfloat16)


def _fp4_scales(kv_ref, rows, head_dim, chunk):
  """f32 UE8M0 scales `[bk, 64]` of the packed bytes of 128-dim chunk `chunk`
  (byte j of the chunk holds dims 2j, 2j + 1 of one 16-dim scale group)."""
  scale_cols = jnp.arange(HALF) // (FP4_GROUP // 2)
  scale_bytes = kv_ref[rows[:, None], (head_dim // 2 + (CHUNK // FP4_GROUP) * chunk + scale_cols)[None, :]]
  return fp_formats.ue8m0_to_f32(scale_bytes)


def _fp4_values(code, scale, valid):
  """e2m1 codes times their scales -> bf16 (exact: e2m1 times a power of
  two), invalid slots selected to 0."""
  return jnp.where(valid[:, None], fp_formats.e2m1_to_f32(code) * scale, 0.0).astype(jnp.bfloat16)


def _fp8_tile(kv_ref, rows, valid, head_dim):
  """Gathered FP8 records -> (bf16 key parts [(chunk, parity)] of [bk, 64]
  unscaled e4m3 values, f32 per-chunk scales [bk])."""
  parts, scales = [], []
  for c in range(head_dim // CHUNK):
    scales.append(_fp8_scale(kv_ref, rows, valid, head_dim, c))
    parts += [_fp8_values(kv_ref[rows, _part_columns(2 * c + parity)], valid) for parity in (0, 1)]
  return parts, scales


def _fp4_tile(kv_ref, rows, valid, head_dim):
  """Gathered FP4 records -> bf16 key parts [(chunk, parity)] of [bk, 64],
  scales applied (exact)."""
  parts = []
  for c in range(head_dim // CHUNK):
    packed = kv_ref[rows, pl.ds(HALF * c, HALF)]  # bytes of dims 128c + 2j, +1
    scale = _fp4_scales(kv_ref, rows, head_dim, c)
    parts += [_fp4_values(code, scale, valid) for code in fp_formats.unpack_e2m1(packed)]
  return parts


def _fp8_value_part(kv_ref, rows, valid, head_dim, part):
  """Value part `part` (traced) of the gathered FP8 records: (bf16 [bk, 64]
  unscaled, f32 scale [bk])."""
  return (_fp8_values(kv_ref[rows, _part_columns(part)], valid), _fp8_scale(kv_ref, rows, valid, head_dim, part // 2))


def _fp4_value_part(kv_ref, rows, valid, head_dim, part):
  """Value part `part` (traced) of the gathered FP4 records: bf16 [bk, 64],
  scaled. Its nibble: low for even dims, high for odd."""
  chunk = part // 2
  packed = kv_ref[rows, pl.ds(HALF * chunk, HALF)].astype(jnp.int32)
  code = (packed >> (4 * (part % 2))) & 0xF
  return _fp4_values(code, _fp4_scales(kv_ref, rows, head_dim, chunk), valid)


def _scores(q_parts, k_parts, scales):
  """Unscaled scores `[bh, bk]` of one key tile: the sum over the (chunk,
  parity) parts of `q . k`; `scales` (FP8 only) multiply each chunk's part."""
  s = None
  for c in range(len(q_parts) // 2):
    part = sum(jnp.dot(q_parts[2 * c + p], k_parts[2 * c + p].T, preferred_element_type=jnp.float32) for p in (0, 1))
    if scales is not None:
      part = part * scales[c][None, :]
    s = part if s is None else s + part
  return s


def _split_kernel(
  q_ref, idx8_ref, idx4_ref, kv8_ref, kv4_ref, scale_ref, o_ref, lse_ref, *, lay: _Layout, block_k: int
):
  # q_ref [bh, D]; idx*_ref [K*]; kv*_ref [rows, bytes]; scale_ref [1];
  # o_ref [bh, D] (this program writes its block_d columns); lse_ref [bh].
  head_dim = lay.head_dim
  block_h = q_ref.shape[0]
  split = pl.program_id(1)
  num_parts = head_dim // HALF
  own_parts = lay.block_d // HALF
  every_part = own_parts == num_parts
  # The value parts (of 64 dims) this program accumulates and writes.
  first_part = (pl.program_id(2) % lay.column_blocks) * own_parts
  parts = list(range(num_parts)) if every_part else [first_part + i for i in range(own_parts)]
  qk_scale = scale_ref[0] * LOG2_E
  q_parts = [q_ref[:, _part_columns(j)] for j in range(num_parts)]
  carry = init_carry(block_h, HALF, parts=own_parts)

  is_fp8 = split < lay.splits8
  base8 = split * lay.keys8
  base4 = (split - lay.splits8) * lay.keys4
  load8 = functools.partial(
    _load_rows, idx8_ref, block_k=block_k, num_slots=lay.k8, num_rows=lay.rows8, masked=lay.k8 % lay.keys8 != 0
  )
  load4 = functools.partial(
    _load_rows, idx4_ref, block_k=block_k, num_slots=lay.k4, num_rows=lay.rows4, masked=lay.k4 % lay.keys4 != 0
  )

  def fp8_body(t, carry):
    rows, valid = load8(base8 + t * block_k)
    k_parts, scales = _fp8_tile(kv8_ref, rows, valid, head_dim)
    if every_part:
      values, value_scales = k_parts, [scales[j // 2] for j in parts]
    else:
      values, value_scales = map(list, zip(*(_fp8_value_part(kv8_ref, rows, valid, head_dim, j) for j in parts)))
    # FP8 scales multiply the probabilities of their chunk's parts (exact
    # values in the dot).
    return online_softmax_step(
      _scores(q_parts, k_parts, scales) * qk_scale,
      carry,
      values,
      visible=valid[None, :],
      value_scales=value_scales,
      p_hi_lo=True,
    )

  def fp4_body(t, carry):
    rows, valid = load4(base4 + t * block_k)
    k_parts = _fp4_tile(kv4_ref, rows, valid, head_dim)
    values = k_parts if every_part else [_fp4_value_part(kv4_ref, rows, valid, head_dim, j) for j in parts]
    return online_softmax_step(
      _scores(q_parts, k_parts, None) * qk_scale, carry, values, visible=valid[None, :], p_hi_lo=True
    )

  # Trip counts from program_id. (Not `jnp.where(is_fp8, n, 0)`: XLA's
  # Triton then rejects the loop, "scf.for ... bounds have same type".)
  in_fp8 = is_fp8.astype(jnp.int32)
  carry = lax.fori_loop(0, in_fp8 * (lay.keys8 // block_k), fp8_body, carry)
  accs, m, l = lax.fori_loop(0, (1 - in_fp8) * (lay.keys4 // block_k), fp4_body, carry)

  for j, part in zip(parts, normalize(accs, m, l)):
    o_ref[:, _part_columns(j)] = part
  lse_ref[...] = lse_base2(m, l)


# ---------------------------------------------------------------------------
# Launcher.


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def mixed_mla_decode(
  q: jax.Array,
  kv_fp8: jax.Array,
  indices_fp8: jax.Array,
  kv_fp4: jax.Array,
  indices_fp4: jax.Array,
  sm_scale: jax.Array,
  attn_sink: jax.Array,
  *,
  config: MixedMlaDecodeConfig | None = None,
  interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Mixed FP8/FP4 MLA decode (SPEC 4.10).

  Args:
    q: `[B, H, D]` bf16; D a multiple of 128; B >= 0.
    kv_fp8: `[N8, P8, 1, D + 4*D/128]` uint8 FP8 token records.
    indices_fp8: `[B, K8]` int32 flat rows `page*P8 + offset`; valid in
      `[0, N8*P8)`, anything else (-1 padding, other negatives, past the
      cache) is an invalid slot that contributes nothing.
    kv_fp4: `[N4, P4, 1, D/2 + D/16]` uint8 FP4 token records.
    indices_fp4: `[B, K4]` int32 flat rows `page*P4 + offset`; valid in
      `[0, N4*P4)`, as above.
    sm_scale: f32 scalar (0-d array or float; may be traced).
    attn_sink: `[H]` f32 sink logits (denominator only).
    config: None = `choose_config`.
    interpret: None = interpret when no GPU is present.

  Returns:
    `(out [B, H, D] bf16, lse [B, H] f32)`; rows with no valid index give
    0 and +inf. A token listed twice counts twice, as in the reference.
  """
  check_inputs(q, kv_fp8, indices_fp8, kv_fp4, indices_fp4, attn_sink)
  batch, heads, head_dim = q.shape
  bytes8, bytes4 = kv_fp8.shape[3], kv_fp4.shape[3]
  if batch == 0:  # nothing to launch
    return jnp.zeros(q.shape, q.dtype), jnp.zeros((0, heads), jnp.float32)
  kv_fp8, indices_fp8 = nonempty(kv_fp8, indices_fp8)
  kv_fp4, indices_fp4 = nonempty(kv_fp4, indices_fp4)
  shapes = {"q": q, "indices_fp8": indices_fp8, "indices_fp4": indices_fp4}
  sizes = MixedMlaSizes.of(shapes)
  config = _fit(config or choose_config(shapes), sizes)
  split_cfg = config.split
  if heads % split_cfg.block_h:
    raise ValueError(f"H={heads} is not a multiple of split.block_h={split_cfg.block_h}")
  rows8, rows4 = kv_fp8.shape[0] * kv_fp8.shape[1], kv_fp4.shape[0] * kv_fp4.shape[1]
  lay = _layout(head_dim, sizes.k8, sizes.k4, rows8, rows4, split_cfg)
  interpret = resolve_interpret(interpret)

  kv8_flat = kv_fp8.reshape(rows8, bytes8)
  kv4_flat = kv_fp4.reshape(rows4, bytes4)
  scale = jnp.asarray(sm_scale, jnp.float32).reshape(1)
  block_h, cols = split_cfg.block_h, lay.column_blocks
  o_part, lse_part = common.pallas_call(
    functools.partial(_split_kernel, lay=lay, block_k=split_cfg.block_k),
    out_shape=(
      jax.ShapeDtypeStruct((batch, lay.splits, heads, head_dim), jnp.float32),
      jax.ShapeDtypeStruct((batch, lay.splits, heads), jnp.float32),
    ),
    # Axis 2: head block major, column block minor.
    grid=(batch, lay.splits, heads // block_h * cols),
    in_specs=[
      pl.BlockSpec((None, block_h, head_dim), lambda b, s, hc: (b, hc // cols, 0)),
      pl.BlockSpec((None, sizes.k8), lambda b, s, hc: (b, 0)),
      pl.BlockSpec((None, sizes.k4), lambda b, s, hc: (b, 0)),
      pl.BlockSpec((rows8, bytes8), lambda b, s, hc: (0, 0)),
      pl.BlockSpec((rows4, bytes4), lambda b, s, hc: (0, 0)),
      pl.BlockSpec((1,), lambda b, s, hc: (0,)),
    ],
    # Whole rows: the column blocks of a head block write their columns of it.
    out_specs=(
      pl.BlockSpec((None, None, block_h, head_dim), lambda b, s, hc: (b, s, hc // cols, 0)),
      pl.BlockSpec((None, None, block_h), lambda b, s, hc: (b, s, hc // cols)),
    ),
    compiler_params=plgpu.CompilerParams(num_warps=split_cfg.num_warps, num_stages=split_cfg.num_stages),
    interpret=interpret,
    name="mixed_mla_decode_split",
  )(q, indices_fp8, indices_fp4, kv8_flat, kv4_flat, scale)

  return combine_splits(
    o_part,
    lse_part,
    attn_sink.astype(jnp.float32),
    stage=config.combine,
    out_dtype=q.dtype,
    with_lse=True,
    name="mixed_mla_decode_combine",
    interpret=interpret,
  )
