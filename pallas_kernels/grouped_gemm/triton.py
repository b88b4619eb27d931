"""FP8 x FP4 m-grouped GEMM (DeepSeek MoE experts) on the Pallas Triton lowering.

    C[m, n] = sum_k a[m,k] 2^(a_scale[m,k//32]-127) * e2m1(b[e,n,k]) 2^(b_scale[e,n,k//32]-127)

with `e = expert_ids[m]`. `a` is float8_e4m3fn [M, K] with UE8M0 scale bytes
[M, K/32]; `b` is packed e2m1 [E, N, K/2] (two codes per byte, low nibble =
even k) with UE8M0 scale bytes [E, N, K/32]. C is bf16, accumulated in fp32.
Rows may come in any order; a row whose expert id is outside [0, E) (-1 is
the padding id) is 0.

FP8 tensor cores (`fp8_mma`). Every e2m1 value is an e4m3 value, so the
weights are decoded in registers straight to e4m3 (values times 2**-6; on a
GPU four packed bytes at a time in inline PTX) and the activations are used
as stored: each 32-k scale group is one fp8 x fp8 dot (`wgmma ... e4m3`,
fp32 result), promoted into the fp32 accumulator times
`a_scale[m] * b_scale[n]` (one mul and one fma per element, DeepGEMM-style
promotion, here per scale group); the decode's 2**-6 is undone once, on
the finished accumulator. A group's products are exact in fp32 (4-bit x
3-bit significands) and the scalings by powers of two are exact (unless
a partial sum's magnitude falls below 2**-120, where the accumulator, which
holds it times 2**-6, would be subnormal), so on a CPU only the fp32
summation order differs from the
reference, which sums bf16 x bf16 products in one dot (results agree to
fp32 rounding; the tests see them bit-equal at small K). On the GPU the
wgmma's accumulation inside one 32-k group is the hardware's (fewer bits
than fp32 for fp8): the promotion bounds it to 32 products.

Operand roles (`swap_ab`). With few rows per expert the weights are the
MMA's M side (wgmma M = 64 per warpgroup over `block_n` columns) and the
`block_m` rows its N side (16 or 32): per-column weight scales become one
register per row of the accumulator, and 16-row tiles still run fp8 wgmma
(`m64n16k32`) instead of falling back to mma.sync; C^T is computed and
stored transposed. `swap_ab=False` puts the activation rows on the M side
(block_m >= 64 for wgmma).

Work without a work list: nothing runs before the launch. Rows are cut into
`block_m` row tiles; grid `(cdiv(N, block_n), expert_slots, row tiles)`:
N tiles fastest (programs running together share a tile's activations),
row tiles slowest (consecutive tiles, which share experts when rows are
grouped, run close together and find an expert's weight slab in L2). Each
program reads its tile's expert ids and ranks the distinct valid experts
in them (`rank_tile_experts`, a [block_m, block_m] comparison, any order);
slot `s` computes the experts of rank s, s + slots, ...: one K loop each
over the tile's rows times that expert's weights, stored for the rows of
that expert; slot 0 also writes the zeros of the tile's rows with invalid
ids. Every row of C is written by exactly one program. A decode step
(M = 6, one token's six experts) is one 16-row tile with six slots: six
weight streams per N tile, never a loop over the 384 experts. Rows grouped
by expert (DeepGEMM's contiguous layout) put one to three experts in most
tiles; ungrouped rows stay correct, with up to `block_m` experts per tile.

Expert items (`expert_items`, prefill). A row tile holding the end of one
expert's rows and the start of the next decodes both experts' weights for
a few rows each: at M = 24576 the 768 32-row tiles make 1067 (tile, expert)
items over 306 experts, each weight byte decoded 3.5 times. With many rows
per expert the wrapper instead builds a work list in XLA (`expert_items`:
rows ordered by expert, a stable sort, and per expert `ceil(rows /
block_m)` items of (expert, first row in that order, rows)); grid `(N
tiles, 1, item slots)`, the slots an upper bound, empty ones exit. An
item gathers its rows by index (any order) and scatters its result rows;
the rows with invalid ids form items of their own that write zeros. At M =
24576, 32-row items are 966 (3.16 decodes per weight byte), 64-row ones
601 (1.96).

Folded scales (`fold_scales`, expert items with the weights as the MMA's M
side; the prefill heuristic). Both scales are powers of two, so they can
ride in the operands instead of a per-group promotion, exactly, in f16:
against each row's largest scale byte over K, `hi` (the activations' row,
the weights' column n), a group whose byte lies d below it becomes
`a x 2^(7 - d)` (every finite e4m3 value, d <= 22) and `w x 2^(9 - d)`
(every e2m1 value, d <= 32): f16 values down to its smallest subnormal,
2^-24, and below its largest (`test_folded_scales_are_exact_over_their_whole_
range`). The f16 wgmma then sums exact products in fp32 over all of K in
one accumulator, and the result is scaled once, by 2^(a_hi - 135) x
2^(b_hi - 135) (the operands' 2^16 and the bias 2 x 127). XLA prepares the
references and the activations' multipliers from the scale bytes (1/32 of
the activations, 1/16 of the weights; `fold_operands`); a row whose scales
do not fold (a wider spread, a byte 0 or 255, a reference below 9) marks
its items for the fp8 path, run in `FOLD_FALLBACK_ROWS`-row slices. Per
item this trades the promotion (two fp32 ops per element and 32 k) for a
dearer decode (one `cvt.rn.f16x2.e4m3x2` and one `mul.rn.f16x2` per byte
more) at half the fp8 tensor rate: at 64 rows per item the folded k-step
issues 428 ALU instructions per warp for 16 `m64n64k16` wgmmas against
570 for 4 fp8 `m64n64k32` ones (docs/perf/moe_kernels.md). The f16 MMA
operands' register fragments hold two consecutive k per register (one
packed byte); the byte pairs a thread loads hold k 4c..4c+3 (the fp8
fragment's), so both operands take the k order `fp8_mma.pair_major`, which
makes a thread's pairs its f16 registers (no shuffles, no shared memory).

A program walks K in `block_k` steps (<= 128: a step's scale bytes are one
word, loaded once per step), each unrolled into its `block_k / 32` scale
groups. Activations: `[block_m, 32]` fp8 bytes (row indices clamped to
M-1; rows past M are never stored). Weights: `[block_n, 8]` pairs of
packed bytes (b viewed as uint16 [E, N, K/4], `byte_pairs`) decoded to
`[block_n, 32]` e4m3 in k order, two pairs per inline-asm instance
(`fp8_mma.e2m1_to_e4m3_operand`). A pair is four k values: with `swap_ab`
one register of the wgmma's register operand (four consecutive k of a
row), so each thread loads exactly its pairs and no bytes are repacked.
K must be a multiple of 32 (the definition's `G`); `block_k` is shrunk to
divide K.
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
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.grouped_gemm.config import GroupedGemmConfig
from pallas_kernels.shared import common
from pallas_kernels.shared.common import NT_DIMS, cdiv, fit_block, fitted_candidates, resolve_interpret
from pallas_kernels.shared.fp8_mma import (
  e2m1_to_e4m3_operand,
  e2m1_to_f16_operand,
  e4m3_to_f16_operand,
  fp8_dot_nt,
  promote,
)
from pallas_kernels.shared.fp_formats import E2M1_E4M3_EXPONENT, ue8m0_to_f32

GROUP = 32  # k values per UE8M0 scale byte (both operands)
MIN_BLOCK_K = GROUP  # a step is whole scale groups


class GroupedGemmSizes(NamedTuple):
  """Problem sizes of the inputs' shapes (input name -> array or ShapeDtypeStruct)."""

  m: int
  n: int
  k: int
  experts: int

  @classmethod
  def of(cls, shapes: Mapping[str, Any]) -> GroupedGemmSizes:
    m, k = shapes["a"].shape
    experts, n, _ = shapes["b"].shape
    return cls(int(m), int(n), int(k), int(experts))


def max_experts_per_tile(m: int, e: int, block_m: int) -> int:
  """The most distinct experts one row tile can hold."""
  return max(1, min(e, block_m, m))


def _fit(config: GroupedGemmConfig, m: int, n: int, k: int, e: int) -> GroupedGemmConfig:
  """Clamps blocks to the problem: block_m/block_n to the next power of two
  of M/N (>= 16), block_k to the largest power of two dividing K (K is a
  multiple of 32, so the K loop never needs a tail mask), the slots to the
  most experts a tile can hold."""
  k_pow2 = k & -k  # largest power of two dividing k
  block_m = fit_block(config.block_m, m)
  slots = 1 if config.expert_items else min(config.expert_slots, max_experts_per_tile(m, e, block_m))
  return dataclasses.replace(
    config,
    block_m=block_m,
    block_n=fit_block(config.block_n, n),
    block_k=max(MIN_BLOCK_K, min(config.block_k, k_pow2)),
    expert_slots=slots,
  )


# Rows per expert (M / E) from which expert items with folded scales
# replace 16-row tiles. Thread-instructions a k-step and 128-column tile
# (sm_90a PTX, docs/perf/moe_kernels.md): a 16-row fp8 tile 381 x 128, a
# 64-row folded item 428 x 128 (no promotion, so the rows cost little);
# the items also need a work list and the scale references (XLA, a pass
# over the scale bytes) before the launch, which pays from about 15 rows
# per expert (the records: M = 11904 and up).
_ROWS_PER_EXPERT_FOR_ITEMS = 15


def _heuristic(m: int, e: int) -> GroupedGemmConfig:
  """The weights as the MMA's M side (`swap_ab`), rows of activations as its
  N side: 16-row tiles on fp8 dots up to `_ROWS_PER_EXPERT_FOR_ITEMS` rows
  per expert, 64-row expert items with folded scales above. Decode (M <=
  16) is one 16-row tile with a slot per expert (6 x 36 programs at M = 6,
  N = 4608): a weight stream.

  Why 64-row folded items (sm_90a PTX, thread-instructions a k-step and
  128-column tile, the records' synthesized routing at M = 24576): 32-row
  fp8 items 563 x 128 over 966 items, 69.6 M; 64-row fp8 items 570 x 256
  over 601, 87.7 M (the per-32-k promotion grows with the rows); 64-row
  folded items 428 x 128 over 601, 32.9 M; 32-row folded items 402 x 128
  over 966, 49.7 M."""
  if m <= 16 or cdiv(m, e) < _ROWS_PER_EXPERT_FOR_ITEMS:
    return GroupedGemmConfig(16, 128, 128, expert_slots=16, swap_ab=True, num_warps=4, num_stages=3)
  return GroupedGemmConfig(64, 128, 128, swap_ab=True, expert_items=True, fold_scales=True, num_warps=4, num_stages=3)


def choose_config(shapes: Mapping[str, Any]) -> GroupedGemmConfig:
  """Heuristic config for the inputs' shapes (input name -> ShapeDtypeStruct)."""
  m, n, k, e = GroupedGemmSizes.of(shapes)
  return _fit(_heuristic(m, e), m, n, k, e)


_SWEEP_CONFIGS = (
  GroupedGemmConfig(16, 64, 128, expert_slots=16, swap_ab=True, num_warps=4, num_stages=3),
  GroupedGemmConfig(16, 128, 128, expert_slots=16, swap_ab=True, num_warps=4, num_stages=3),
  GroupedGemmConfig(16, 256, 128, expert_slots=4, swap_ab=True, num_warps=8, num_stages=3),
  GroupedGemmConfig(32, 128, 128, expert_slots=2, swap_ab=True, num_warps=4, num_stages=4),
  GroupedGemmConfig(32, 256, 128, expert_slots=2, swap_ab=True, num_warps=8, num_stages=3),
  GroupedGemmConfig(64, 128, 128, expert_slots=2, swap_ab=True, num_warps=8, num_stages=3),
  GroupedGemmConfig(64, 128, 128, expert_slots=2, num_warps=8, num_stages=3),
  GroupedGemmConfig(128, 64, 128, expert_slots=2, num_warps=8, num_stages=3),
  GroupedGemmConfig(32, 128, 128, swap_ab=True, expert_items=True, num_warps=4, num_stages=4),
  GroupedGemmConfig(64, 128, 128, swap_ab=True, expert_items=True, num_warps=8, num_stages=3),
  GroupedGemmConfig(128, 64, 128, expert_items=True, num_warps=8, num_stages=3),
  GroupedGemmConfig(32, 128, 128, swap_ab=True, expert_items=True, fold_scales=True, num_warps=4, num_stages=4),
  GroupedGemmConfig(64, 128, 128, swap_ab=True, expert_items=True, fold_scales=True, num_warps=4, num_stages=3),
  GroupedGemmConfig(128, 128, 128, swap_ab=True, expert_items=True, fold_scales=True, num_warps=8, num_stages=3),
)


def candidate_configs(shapes: Mapping[str, Any]) -> list[GroupedGemmConfig]:
  """Configs a sweep may try, the heuristic's first."""
  m, n, k, e = GroupedGemmSizes.of(shapes)
  return fitted_candidates(choose_config(shapes), _SWEEP_CONFIGS, lambda c: _fit(c, m, n, k, e))


def rank_tile_experts(ids, num_experts: int):
  """The distinct valid experts of a tile's ids (any order, repeats, invalid
  ids) ranked by id: `(key, first, rank, count)`.

  `key[r]` is row r's expert, or `num_experts` for an id outside
  [0, num_experts); `first[r]` marks the first row of each distinct valid
  expert; `rank[r]` counts the distinct valid experts below `key[r]`; `count`
  the distinct valid experts. The expert of rank j is `key` at the `first`
  row whose rank is j. Integer ops only (a kernel body or plain jnp).
  """
  rows = ids.shape[0]
  valid = (ids >= 0) & (ids < num_experts)
  key = jnp.where(valid, ids, num_experts)
  row = lax.broadcasted_iota(jnp.int32, (rows, rows), 0)
  other = lax.broadcasted_iota(jnp.int32, (rows, rows), 1)
  seen_before = jnp.where((key[:, None] == key[None, :]) & (other < row), 1, 0)
  first = valid & (jnp.max(seen_before, axis=1) == 0)
  below = jnp.where(first[None, :] & (key[None, :] < key[:, None]), 1, 0)
  rank = jnp.sum(below, axis=1)
  count = jnp.sum(jnp.where(first, 1, 0))
  return key, first, rank, count


# Folded scales (`fold_scales`): f16 operands carrying their scales relative
# to their row's largest over K (the reference exponent, `hi`):
# a = e4m3 x 2^(7 - d_a), w = e2m1 x 2^(9 - d_b) (the decode's 2^-6 times
# 2^(15 - d_b)), d = hi - the group's scale byte. Exact while d_a <= 22 and
# d_b <= 32 (f16's smallest subnormal, 2^-24, is the last bit kept) and
# within f16's range (448 x 2^7, 6 x 2^9). The f32 MMA sum is then the
# product times 2^(16 - a_hi - b_hi + 254), undone once at the end.
FOLD_A_EXPONENT = 7
FOLD_B_EXPONENT = 15
FOLD_A_MAX_SHIFT = 22
FOLD_B_MAX_SHIFT = 32
FOLD_UNSHIFT = 127 + 8  # each row's factor 2^(hi - 135): 2 x 135 = 254 + 16
# Rows of an item whose scales do not fold are computed on fp8 dots in
# slices of this many rows (the fp8 path's accumulator and partial product
# for all of a 64-row item would set the kernel's register count).
FOLD_FALLBACK_ROWS = 32
# Scale groups a lone row's block puts side by side in the MMA's 16 columns.
LONE_ROW_GROUPS = 16


def f32_pow2(e):
  """2^e as float32 for int32 e in the normal range [-126, 127]."""
  return lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def f16_pow2(e):
  """2^e as float16 for int32 e in [-24, 15] (exact: a power of two f16 holds)."""
  return f32_pow2(e).astype(jnp.float16)


def scale_byte(words, g: int):
  """Byte g of scale words (scale group g of a k-step) as int32."""
  return (words >> (8 * g)).astype(jnp.int32) & 0xFF


def _fold_reference(scales: jax.Array, max_shift: int) -> jax.Array:
  """UE8M0 bytes [..., K/32] -> int32 [...]: each row's largest byte, the
  reference its scales fold against, or -1 where they do not fold exactly
  (a byte 0 or 255, a unit factor 2^(hi - 135) below fp32's normal range,
  or a byte more than `max_shift` below the largest)."""
  hi = jnp.max(scales, axis=-1).astype(jnp.int32)
  lo = jnp.min(scales, axis=-1).astype(jnp.int32)
  ok = (lo >= 1) & (hi <= 254) & (hi - FOLD_UNSHIFT >= -126) & (hi - lo <= max_shift)
  return jnp.where(ok, hi, -1)


def fold_operands(a: jax.Array, a_scale: jax.Array, b_scale: jax.Array) -> tuple[jax.Array, ...]:
  """What folded scales need besides the operands (XLA, before the launch;
  the scale bytes are 1/32 of the activations and 1/16 of the weights):
  the fp8 activations as uint16 byte pairs [M, K/2]; each activation
  group's f16 multiplier 2^(7 - (hi - s)) [M, K/32] (rows that do not fold:
  1); the rows' references, int32 [M] and [E, N] (-1: does not fold)."""
  m, k = a.shape
  a_fold = _fold_reference(a_scale, FOLD_A_MAX_SHIFT)
  shift = jnp.where(a_fold[:, None] >= 0, FOLD_A_EXPONENT - (a_fold[:, None] - a_scale.astype(jnp.int32)), 0)
  a_mult = f32_pow2(shift).astype(jnp.float16)
  a_pairs = lax.bitcast_convert_type(lax.bitcast_convert_type(a, jnp.uint8).reshape(m, k // 2, 2), jnp.uint16)
  return a_pairs, a_mult, a_fold, _fold_reference(b_scale, FOLD_B_MAX_SHIFT)


def dot_operand_dtype(config: Any = None):
  """The dtype the kernel's tensor-core dots take (the roofline judges the
  FLOPs against that peak): folded scales (`fold_scales`) run f16 dots;
  every other config decodes the e2m1 weights to e4m3 and runs fp8 x fp8
  dots (`fp8_mma.fp8_dot_nt`), as do folded items whose scales do not
  fold. The Mosaic GPU kernel's configs (no `fold_scales` field) run f16
  dots. No config: fp8 (the higher peak)."""
  if config is None:
    return jnp.float8_e4m3fn
  return jnp.float16 if getattr(config, "fold_scales", True) else jnp.float8_e4m3fn


def _grouped_gemm_kernel(
  ids_ref,
  a_ref,
  a_scale_ref,
  b_ref,
  b_scale_ref,
  a_bytes_ref,
  b_bytes_ref,
  *refs,
  m: int,
  n: int,
  k: int,
  e: int,
  block_m: int,
  block_n: int,
  block_k: int,
  slots: int,
  swap_ab: bool,
  items: bool,
  fold: bool,
  ptx: bool,
):
  # Whole-array refs: a/ids [M, ...], b [E, N, K/2], c [M, N]; the scales as
  # words of one k-step's scale bytes: a_scale [M, K/block_k],
  # b_scale [E, N, K/block_k] (byte g = scale group g of the step), and as
  # bytes [M, K/32], [E, N, K/32] (a lone row's block of 16 groups). With
  # `items`, `refs` starts with the work list (`expert_items`): the row
  # order [M] and the item table [3, item slots]; with `fold`, then the
  # folded scales' operands (`fold_operands`).
  *extra_refs, c_ref = refs
  n0 = pl.program_id(0) * block_n
  cols = n0 + lax.broadcasted_iota(jnp.int32, (block_n,), 0)
  cols_c = jnp.minimum(cols, n - 1)
  b_rows = cols_c[:, None]  # [block_n, 1]
  k_in_group = lax.broadcasted_iota(jnp.int32, (1, GROUP), 1)  # [1, 32]
  pair_in_group = lax.broadcasted_iota(jnp.int32, (1, GROUP // 4), 1)  # [1, 8]
  groups_per_step = block_k // GROUP
  steps = k // block_k

  def fp8_product(expert, rows_c):
    """The expert's product for rows `rows_c` (clamped row indices), fp32 in
    the MMA's orientation (C^T [block_n, rows] with `swap_ab`): fp8 dots,
    one promotion per 32-k scale group."""
    a_rows = rows_c[:, None]

    def step(kk, acc):
      a_words = a_scale_ref[rows_c, kk]  # [rows]
      b_words = b_scale_ref[expert, cols_c, kk]  # [block_n]
      # One block_k step = block_k / 32 scale groups, unrolled: within a
      # group both operands have one scale per row, so scales are vectors.
      for g in range(groups_per_step):
        group = kk * groups_per_step + g
        a_op = lax.bitcast_convert_type(a_ref[a_rows, group * GROUP + k_in_group], jnp.float8_e4m3fn)
        b_op = e2m1_to_e4m3_operand(b_ref[expert, b_rows, group * (GROUP // 4) + pair_in_group], ptx=ptx)
        a_scale = ue8m0_to_f32(a_words >> (8 * g))
        b_scale = ue8m0_to_f32(b_words >> (8 * g))
        if swap_ab:  # the weights are the MMA's M side: acc is C^T [block_n, rows]
          acc = promote(acc, fp8_dot_nt(b_op, a_op), b_scale[:, None], a_scale[None, :], ptx=ptx)
        else:
          acc = promote(acc, fp8_dot_nt(a_op, b_op), a_scale[:, None], b_scale[None, :], ptx=ptx)
      return acc

    # The weights decode to e4m3 values times 2**-6: restored on the
    # finished accumulator (once per output, not once per scale group).
    rows = rows_c.shape[0]
    acc = jnp.zeros((block_n, rows) if swap_ab else (rows, block_n), jnp.float32)
    return lax.fori_loop(0, steps, step, acc) * jnp.float32(2.0**E2M1_E4M3_EXPONENT)

  if not items:
    lone_row = None
    if swap_ab:
      lone_row = functools.partial(
        _lone_row_product, a_ref, a_bytes_ref, b_ref, b_bytes_ref, cols_c=cols_c, k=k, block_k=block_k, ptx=ptx
      )
    _store_tile_experts(
      fp8_product,
      lone_row,
      c_ref,
      ids_ref,
      cols,
      m=m,
      n=n,
      e=e,
      block_m=block_m,
      block_n=block_n,
      slots=slots,
      swap_ab=swap_ab,
    )
    return
  folded = None
  if fold:
    folded = functools.partial(
      _folded_product,
      *extra_refs[2:],
      b_ref,
      b_scale_ref,
      cols_c=cols_c,
      groups_per_step=groups_per_step,
      steps=steps,
      swap_ab=swap_ab,
      ptx=ptx,
    )
  _store_items(fp8_product, folded, *extra_refs, c_ref, cols_c=cols_c, m=m, e=e, block_m=block_m, swap_ab=swap_ab)


def _store_items(
  fp8_product, folded_product, order_ref, table_ref, *refs, cols_c, m: int, e: int, block_m: int, swap_ab: bool
):
  """Expert items (`expert_items`): this program's item, up to `block_m`
  rows of one expert, gathered by index and scattered back; with
  `folded_product` (`fold_scales`) on folded scales when all of the item's
  rows and weight rows fold, else on fp8 dots in slices of rows; the item
  of invalid ids writes zeros. `refs`: the folded scales' operands, then C."""
  *fold_refs, c_ref = refs
  item = pl.program_id(2)
  item_expert, item_start, item_rows = table_ref[0, item], table_ref[1, item], table_ref[2, item]

  def rows_of_lanes(first_lane: int, lanes: int):
    # The item's rows (any order); lanes past its rows repeat them (`lane
    # mod rows`), as clamped columns repeat column N - 1: such lanes compute
    # and store the same values as the lanes they repeat, so the scatter
    # needs no mask but the empty slot's (a masked lane would, in interpret
    # mode, store the old value back over its duplicate).
    lane = lax.rem(first_lane + lax.broadcasted_iota(jnp.int32, (lanes,), 0), jnp.maximum(item_rows, 1))
    return order_ref[jnp.minimum(item_start + lane, m - 1)]

  def store_rows(rows_c, acc):
    # C^T with swap_ab, stored through transposed indices: a transpose of
    # the accumulator would let Triton swap the MMA's operands back.
    out = c_ref.at[rows_c[None, :], cols_c[:, None]] if swap_ab else c_ref.at[rows_c[:, None], cols_c[None, :]]
    plgpu.store(out, acc.astype(c_ref.dtype), mask=jnp.broadcast_to(item_rows > 0, acc.shape))

  rows_c = rows_of_lanes(0, block_m)

  def item_product():
    if folded_product is None:
      return store_rows(rows_c, fp8_product(item_expert, rows_c))
    _, _, a_fold_ref, b_fold_ref = fold_refs
    # Fold when every row of the item and every weight row folds (-1: not);
    # else fp8 dots on slices of the rows (fewer registers than all of them).
    foldable = jnp.minimum(jnp.min(a_fold_ref[rows_c]), jnp.min(b_fold_ref[item_expert, cols_c]))
    slice_rows = min(block_m, FOLD_FALLBACK_ROWS)

    def fallback():
      for first_lane in range(0, block_m, slice_rows):
        rows = rows_of_lanes(first_lane, slice_rows)
        store_rows(rows, fp8_product(item_expert, rows))

    lax.cond(foldable >= 0, lambda: store_rows(rows_c, folded_product(item_expert, rows_c)), fallback)

  zeros_shape = (cols_c.shape[0], block_m) if swap_ab else (block_m, cols_c.shape[0])
  pl.when(item_expert < e)(item_product)
  pl.when(item_expert == e)(  # the rows with invalid ids (and empty item slots: no rows)
    lambda: store_rows(rows_c, jnp.zeros(zeros_shape, jnp.float32))
  )


def _lone_row_product(a_ref, a_bytes_ref, b_ref, b_bytes_ref, expert, row, *, cols_c, k: int, block_k: int, ptx: bool):
  """The expert's product for its one row `row` of a tile, fp32 [block_n]
  (`swap_ab` decode). The MMA's 16 columns hold 16 scale groups of that row:
  the activations laid block-diagonally (column j: the row's group j of a
  16-group block, zeros elsewhere), so a block's wgmmas sum each group into
  its own column, accumulating onto it in place, and the promotion, two
  fp32 ops an element, runs once per block, on columns that are all the
  row's (the 16-row fp8 path promotes all 16 columns every group)."""
  block_n = cols_c.shape[0]
  b_rows = cols_c[:, None]
  groups_per_step = block_k // GROUP
  steps = k // block_k
  steps_per_block = LONE_ROW_GROUPS // groups_per_step
  column = lax.broadcasted_iota(jnp.int32, (LONE_ROW_GROUPS, 1), 0)  # [16, 1]
  k_in_step = lax.broadcasted_iota(jnp.int32, (1, block_k), 1)  # [1, block_k]
  pair_in_step = lax.broadcasted_iota(jnp.int32, (1, block_k // 4), 1)  # [1, block_k / 4]
  group_in_block = lax.broadcasted_iota(jnp.int32, (LONE_ROW_GROUPS,), 0)  # [16]

  def block(first_step, acc, block_steps: int):
    part = jnp.zeros((block_n, LONE_ROW_GROUPS), jnp.float32)
    for q in range(block_steps):
      kk = first_step + q
      a_row = a_ref[row, kk * block_k + k_in_step]  # [1, block_k]
      a_op = jnp.where(column == q * groups_per_step + k_in_step // GROUP, a_row, 0).astype(jnp.uint8)
      b_op = e2m1_to_e4m3_operand(b_ref[expert, b_rows, kk * (block_k // 4) + pair_in_step], ptx=ptx)
      part = fp8_dot_nt(b_op, lax.bitcast_convert_type(a_op, jnp.float8_e4m3fn), part)
    # A short last block's unused columns hold zeros: their scales are 0
    # too (a clamped index could read a 255 byte, inf, and 0 x inf = NaN).
    used = group_in_block < block_steps * groups_per_step
    scale_group = jnp.minimum(first_step * groups_per_step + group_in_block, k // GROUP - 1)
    a_scale = jnp.where(used, ue8m0_to_f32(a_bytes_ref[row, scale_group]), 0.0)
    b_scale = jnp.where(used[None, :], ue8m0_to_f32(b_bytes_ref[expert, b_rows, scale_group[None, :]]), 0.0)
    return promote(acc, part, b_scale, a_scale[None, :], ptx=ptx)

  acc = jnp.zeros((block_n, LONE_ROW_GROUPS), jnp.float32)
  full = steps // steps_per_block
  acc = lax.fori_loop(0, full, lambda i, acc: block(i * steps_per_block, acc, steps_per_block), acc)
  if steps % steps_per_block:
    acc = block(full * steps_per_block, acc, steps % steps_per_block)
  # The weights decode to e4m3 values times 2**-6 (as in the fp8 path).
  return jnp.sum(acc, axis=1) * jnp.float32(2.0**E2M1_E4M3_EXPONENT)


def _folded_product(
  a_pairs_ref,
  a_mult_ref,
  a_fold_ref,
  b_fold_ref,
  b_ref,
  b_scale_ref,
  expert,
  rows_c,
  *,
  cols_c,
  groups_per_step: int,
  steps: int,
  swap_ab: bool,
  ptx: bool,
):
  """The expert's product for rows `rows_c` with folded scales (module
  docstring), fp32 in the MMA's orientation: f16 dots accumulated over all
  of K, then each row's and column's unit factor."""
  a_rows, b_rows = rows_c[:, None], cols_c[:, None]
  pair_in_group = lax.broadcasted_iota(jnp.int32, (1, GROUP // 4), 1)  # [1, 8]
  half_in_group = lax.broadcasted_iota(jnp.int32, (1, GROUP // 2), 1)  # [1, 16]

  def step(kk, acc):
    # Loaded here, not before the loop: a value from outside the loop
    # would fix the layout of the weights' decode, which Triton would then
    # move into the MMA's register layout through shared memory.
    b_hi = b_fold_ref[expert, cols_c]
    b_words = b_scale_ref[expert, cols_c, kk]
    for g in range(groups_per_step):
      group = kk * groups_per_step + g
      a_op = e4m3_to_f16_operand(
        a_pairs_ref[a_rows, group * (GROUP // 2) + half_in_group], a_mult_ref[rows_c, group][:, None], ptx=ptx
      )
      b_shift = FOLD_B_EXPONENT - (b_hi - scale_byte(b_words, g))
      b_op = e2m1_to_f16_operand(
        b_ref[expert, b_rows, group * (GROUP // 4) + pair_in_group], f16_pow2(b_shift)[:, None], ptx=ptx
      )
      lhs, rhs = (b_op, a_op) if swap_ab else (a_op, b_op)
      acc = acc + lax.dot_general(lhs, rhs, NT_DIMS, preferred_element_type=jnp.float32)
    return acc

  shape = (cols_c.shape[0], rows_c.shape[0]) if swap_ab else (rows_c.shape[0], cols_c.shape[0])
  acc = lax.fori_loop(0, steps, step, jnp.zeros(shape, jnp.float32))
  a_unit = f32_pow2(a_fold_ref[rows_c] - FOLD_UNSHIFT)
  b_unit = f32_pow2(b_fold_ref[expert, cols_c] - FOLD_UNSHIFT)
  return acc * (b_unit[:, None] * a_unit[None, :] if swap_ab else a_unit[:, None] * b_unit[None, :])


def _store_tile_experts(
  product,
  lone_row,
  c_ref,
  ids_ref,
  cols,
  *,
  m: int,
  n: int,
  e: int,
  block_m: int,
  block_n: int,
  slots: int,
  swap_ab: bool,
):
  """Row tiles without a work list: this program's slot computes the tile's
  experts of rank slot, slot + slots, ... (`rank_tile_experts`), each stored
  for the rows of that expert (an expert with one row of the tile through
  `lone_row` when given); slot 0 writes the zeros of invalid rows."""
  slot = pl.program_id(1)
  row0 = pl.program_id(2) * block_m
  rows = row0 + lax.broadcasted_iota(jnp.int32, (block_m,), 0)
  rows_c = jnp.minimum(rows, m - 1)  # clamped: loads need no mask
  ids = jnp.where(rows < m, ids_ref[rows_c], -1)
  key, first, rank, count = rank_tile_experts(ids, e)
  store_ok = (rows < m)[:, None] & (cols < n)[None, :]
  n0 = pl.program_id(0) * block_n
  out_block = c_ref.at[pl.ds(row0, block_m), pl.ds(n0, block_n)]

  def store_expert(j):
    expert = jnp.max(jnp.where(first & (rank == j), key, -1))
    mine = (key == expert)[:, None]

    def store_rows():
      acc = product(expert, rows_c)
      plgpu.store(out_block, (acc.T if swap_ab else acc).astype(c_ref.dtype), mask=mine & store_ok)

    if lone_row is None:
      return store_rows()
    row = jnp.max(jnp.where(key == expert, rows_c, -1))

    def store_row():
      out = c_ref.at[row, pl.ds(n0, block_n)]
      plgpu.store(out, lone_row(expert, row).astype(c_ref.dtype), mask=cols < n)

    lax.cond(jnp.sum(jnp.where(key == expert, 1, 0)) == 1, store_row, store_rows)

  @pl.when(slot == 0)
  def _zero_invalid_rows():
    invalid = (key == e)[:, None]
    plgpu.store(out_block, jnp.zeros((block_m, block_n), c_ref.dtype), mask=invalid & store_ok)

  if slots >= max_experts_per_tile(m, e, block_m):  # every expert of a tile has its own slot
    pl.when(slot < count)(lambda: store_expert(slot))
  else:
    turns = jnp.maximum(count - slot + slots - 1, 0) // slots

    def turn(t, carry):
      store_expert(slot + t * slots)
      return carry

    lax.fori_loop(0, turns, turn, 0)


def item_slots(m: int, e: int, block_m: int) -> int:
  """An upper bound on the items of `expert_items`: sum over the ids' keys
  (E + 1 with the invalid one) of ceil(rows / block_m) <= M / block_m plus
  one per key present."""
  return cdiv(m, block_m) + min(e + 1, m)


def expert_items(expert_ids: jax.Array, num_experts: int, block_m: int) -> tuple[jax.Array, jax.Array]:
  """The work list of expert items (XLA, before the launch): `order` [M]
  int32, the rows stably sorted by key (the expert id, `num_experts` for an
  id outside [0, E)), and `table` [3, item_slots] int32 whose column `i` is
  item i's (key, first position in `order`, rows): each key's rows cut
  into items of `block_m` in order, keys ascending, every row in exactly
  one item; slots past the last item have key `num_experts` and 0 rows."""
  m = expert_ids.shape[0]
  ids = expert_ids.astype(jnp.int32)
  key = jnp.where((ids >= 0) & (ids < num_experts), ids, num_experts)
  order = jnp.argsort(key, stable=True).astype(jnp.int32)
  rows = jnp.zeros((num_experts + 1,), jnp.int32).at[key].add(1)
  first_row = jnp.cumsum(rows) - rows
  items = (rows + block_m - 1) // block_m
  items_end = jnp.cumsum(items)
  slot = jnp.arange(item_slots(m, num_experts, block_m), dtype=jnp.int32)
  owner = jnp.minimum(jnp.searchsorted(items_end, slot, side="right", method="compare_all"), num_experts)
  local = slot - (items_end[owner] - items[owner])
  count = jnp.where(slot < items_end[-1], jnp.clip(rows[owner] - local * block_m, 0, block_m), 0)
  table = jnp.stack([owner, first_row[owner] + local * block_m, count]).astype(jnp.int32)
  return order, table


_WORD_TYPES = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def scale_words(scales: jax.Array, groups_per_step: int) -> jax.Array:
  """UE8M0 scale bytes [..., K/32] -> one unsigned word per k-step
  [..., K/block_k], byte g holding the step's scale group g (a bitcast:
  the kernel loads a step's scales at once)."""
  *lead, groups = scales.shape
  if groups_per_step == 1:
    return scales
  return lax.bitcast_convert_type(
    scales.reshape(*lead, groups // groups_per_step, groups_per_step), _WORD_TYPES[groups_per_step]
  )


def byte_pairs(packed: jax.Array) -> jax.Array:
  """Packed e2m1 bytes [..., K/2] -> uint16 pairs [..., K/4] (a bitcast,
  the low byte first): the kernel loads a pair's four k values at once."""
  *lead, width = packed.shape
  return lax.bitcast_convert_type(packed.reshape(*lead, width // 2, 2), jnp.uint16)


def check_operands(a, a_scale, b, b_scale, expert_ids) -> None:
  """Raises ValueError naming the input whose shape or dtype breaks the
  contract of `grouped_gemm_fp8_fp4`."""
  if a.ndim != 2 or b.ndim != 3:
    raise ValueError(f"a must be [M, K] and b [E, N, K/2], got a {a.shape} and b {b.shape}")
  m, k = a.shape
  e, n, k_packed = b.shape
  if k % GROUP or k_packed * 2 != k:
    raise ValueError(f"K={k} must be a multiple of {GROUP} and b [E, N, K/2] = [{e}, {n}, {k // 2}], got b {b.shape}")
  expected = {
    "a_scale": (a_scale, (m, k // GROUP), jnp.uint8),
    "b_scale": (b_scale, (e, n, k // GROUP), jnp.uint8),
    "expert_ids": (expert_ids, (m,), None),
    "b": (b, b.shape, jnp.uint8),
    "a": (a, a.shape, jnp.float8_e4m3fn),
  }
  for name, (x, shape, dtype) in expected.items():
    if x.shape != shape:
      raise ValueError(f"{name} must have shape {shape} for M={m}, E={e}, N={n}, K={k}, got {x.shape}")
    if dtype is not None and x.dtype != dtype:
      raise ValueError(f"{name} must be {jnp.dtype(dtype).name}, got {x.dtype}")
  if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
    raise ValueError(f"expert_ids must be integers, got {expert_ids.dtype}")


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def grouped_gemm_fp8_fp4(
  a: jax.Array,
  a_scale: jax.Array,
  b: jax.Array,
  b_scale: jax.Array,
  expert_ids: jax.Array,
  *,
  config: GroupedGemmConfig | None = None,
  interpret: bool | None = None,
) -> jax.Array:
  """C [M, N] bf16 of the FP8 x FP4 m-grouped GEMM (module docstring).

  a [M, K] float8_e4m3fn, a_scale [M, K/32] uint8, b [E, N, K/2] uint8,
  b_scale [E, N, K/32] uint8, expert_ids [M] integer: rows in any order,
  an id outside [0, E) gives a row of zeros. `config=None` picks
  `choose_config`; a given config is fitted to the problem.
  `interpret=None` interprets when no GPU is present.
  """
  check_operands(a, a_scale, b, b_scale, expert_ids)
  m, k = a.shape
  e, n, _ = b.shape
  if m == 0 or n == 0:
    return jnp.zeros((m, n), jnp.bfloat16)
  config = _fit(config or choose_config({"a": a, "b": b}), m, n, k, e)
  interpret = resolve_interpret(interpret)
  # fp8 travels as its bytes; the kernel bitcasts them back (masked or
  # gathered fp8 loads do not lower).
  steps = config.block_k // GROUP
  operands = (
    expert_ids.astype(jnp.int32),
    lax.bitcast_convert_type(a, jnp.uint8),
    scale_words(a_scale, steps),
    byte_pairs(b),
    scale_words(b_scale, steps),
    a_scale,
    b_scale,
  )

  def whole(x):
    return pl.BlockSpec(x.shape, lambda *_, nd=x.ndim: (0,) * nd)

  row_programs = cdiv(m, config.block_m)
  if config.expert_items:
    operands += expert_items(expert_ids, e, config.block_m)
    row_programs = operands[-1].shape[1]
  if config.fold_scales:
    operands += fold_operands(a, a_scale, b_scale)

  kernel = functools.partial(
    _grouped_gemm_kernel,
    m=m,
    n=n,
    k=k,
    e=e,
    block_m=config.block_m,
    block_n=config.block_n,
    block_k=config.block_k,
    slots=config.expert_slots,
    swap_ab=config.swap_ab,
    items=config.expert_items,
    fold=config.fold_scales,
    ptx=not interpret,
  )
  return common.pallas_call(
    kernel,
    out_shape=jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
    grid=(cdiv(n, config.block_n), config.expert_slots, row_programs),
    in_specs=[whole(x) for x in operands],
    out_specs=pl.BlockSpec((m, n), lambda *_: (0, 0)),
    compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
    interpret=interpret,
    name="grouped_gemm_fp8_fp4",
  )(*operands)
