"""FP8 x FP4 m-grouped GEMM (DeepSeek MoE experts) on the Pallas Triton lowering.

    C[m, n] = sum_k a[m,k] 2^(a_scale[m,k//32]-127) * e2m1(b[e,n,k]) 2^(b_scale[e,n,k//32]-127)

with `e = expert_ids[m]`; rows with `e = -1` are padding and give 0. `a` is
float8_e4m3fn [M, K] with UE8M0 scale bytes [M, K/32]; `b` is packed e2m1
[E, N, K/2] (two codes per byte, low nibble = even k) with UE8M0 scale bytes
[E, N, K/32]. Rows are grouped contiguously by expert (expert ids
nondecreasing over the valid rows, -1 rows anywhere, e.g. DeepGEMM's
per-group block padding). C is bf16, accumulated in fp32.

Group-aware tiling (as ragged / megablox GEMMs do). Rows are cut into
`block_m` row tiles; a tile that straddles group boundaries is visited once
per expert it contains. A few small XLA ops before the launch build the work
list: one item `(tile, expert, first)` per (tile, expert present in the
tile), plus one `(tile, -1, first)` item for a tile holding only -1 rows.
Items are ordered by tile then expert, and the list has the static length
`num_m_tiles + min(E, M) - 1`, a bound that holds because experts only
increase along the valid rows (each extra item of a tile starts a new
expert); unused entries at the end are `(0, -1, 0)` and do nothing. A decode
step (M = 6, one token's six experts) is one tile and six items: the kernel
never loops over the 384 experts.

Grid `(cdiv(N, block_n), work-list length)`, N-tiles fastest, so programs
running together share one item's activation rows and consecutive items of
one expert (a straddled tile) share its weight slab in L2. A program loads
its item, then walks K in `block_k` steps, each unrolled into its
`block_k / 32` scale groups, so that within a group every operand row has a
single scale (row vectors, no per-element scale gathers):
* activations: the tile's `[block_m, 32]` fp8 bytes (row indices clamped to
  M-1; rows past M are never stored), times 2^(a_scale - 127), -> bf16;
* weights: the expert's `[block_n, 16]` packed bytes; low nibbles (even k)
  and high nibbles (odd k) decoded to fp32 with integer ops
  (`e2m1_bytes_to_f32`: an fp16 bit trick, exactly `fp_formats.e2m1_to_f32`),
  times 2^(b_scale - 127), -> bf16, and
  interleaved back into k order (`stack(..., -1).reshape`, Triton's join);
* `acc += a @ b^T` (K = 32 per dot, fp32 accumulation).
Scaling before the dot is exact: an e4m3 or e2m1 value times a power of two
is a bf16 number (while it stays in the normal range, as realistic scales
do), and the
products of two such numbers are exact in fp32, so only the fp32 summation
order differs from the reference. The item's rows (`expert_ids == e`) are
stored with a row mask; the first item of a tile also writes zeros to the
tile's -1 rows. Every row of C is written by exactly one item.

Preconditions (the definition's; not checked by the kernel, while the
reference accepts any row order): expert ids are < E and nondecreasing over
the valid rows; otherwise the work list overflows its bound and rows are
silently dropped. K is a multiple of 32
(the definition's `G`); `block_k` is shrunk to divide K.
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

from pallas_kernels.common import NT_DIMS, cdiv, fit_block, fitted_candidates, next_pow2, resolve_interpret
from pallas_kernels.config_rules import DOT_BLOCK, NUM_STAGES, NUM_WARPS, KernelConfig, field, pow2
from pallas_kernels.fp_formats import ue8m0_to_f32

GROUP = 32  # k values per UE8M0 scale byte (both operands)
MIN_BLOCK_K = GROUP  # a step is whole scale groups


@dataclasses.dataclass(frozen=True)
class GroupedGemmConfig(KernelConfig):
  """Tiling of the grouped GEMM; `block_k` is whole 32-k scale groups."""
  block_m: int = field(64, DOT_BLOCK)
  block_n: int = field(128, DOT_BLOCK)
  block_k: int = field(128, pow2(MIN_BLOCK_K))
  num_warps: int = field(8, NUM_WARPS)
  num_stages: int = field(3, NUM_STAGES)


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


def _fit(config: GroupedGemmConfig, m: int, n: int, k: int) -> GroupedGemmConfig:
  """Clamps blocks to the problem: block_m/block_n to the next power of two
  of M/N (>= 16), block_k to the largest power of two dividing K (K is a
  multiple of 32, so the K loop never needs a tail mask)."""
  k_pow2 = k & -k  # largest power of two dividing k
  return dataclasses.replace(
      config,
      block_m=fit_block(config.block_m, m),
      block_n=fit_block(config.block_n, n),
      block_k=max(MIN_BLOCK_K, min(config.block_k, k_pow2)))


def _heuristic(m: int, e: int) -> GroupedGemmConfig:
  """Row tile from the mean rows per expert (M / E): straddled tiles cost a
  full tile of MMA per extra expert, so tiles near the group size waste
  least; 16 for decode (M = 6..18), 64 at M = 24576 over 384 experts.
  Decode is a weight stream: narrow N tiles give enough programs
  (6 items x 72 N tiles at N = 4608)."""
  rows_per_expert = cdiv(m, e)
  block_m = min(128, max(16, next_pow2(rows_per_expert)))
  if m <= 64:
    return GroupedGemmConfig(16, 64, 128, num_warps=4, num_stages=3)
  if block_m == 16:
    return GroupedGemmConfig(16, 128, 128, num_warps=4, num_stages=3)
  if block_m == 32:  # 4 warps would need > 128 registers and spill
    return GroupedGemmConfig(32, 128, 128, num_warps=8, num_stages=3)
  return GroupedGemmConfig(block_m, 128, 128, num_warps=8, num_stages=3)


def choose_config(shapes: Mapping[str, Any]) -> GroupedGemmConfig:
  """Heuristic config for the inputs' shapes (input name -> ShapeDtypeStruct)."""
  m, n, k, e = GroupedGemmSizes.of(shapes)
  return _fit(_heuristic(m, e), m, n, k)


_SWEEP_CONFIGS = (
    GroupedGemmConfig(16, 64, 128, num_warps=4, num_stages=3),
    GroupedGemmConfig(16, 128, 128, num_warps=4, num_stages=3),
    GroupedGemmConfig(32, 128, 128, num_warps=8, num_stages=3),
    GroupedGemmConfig(64, 128, 128, num_warps=8, num_stages=3),
    GroupedGemmConfig(64, 128, 64, num_warps=4, num_stages=4),
    GroupedGemmConfig(128, 128, 128, num_warps=8, num_stages=3),
    GroupedGemmConfig(64, 256, 64, num_warps=8, num_stages=3),
)


def candidate_configs(shapes: Mapping[str, Any]) -> list[GroupedGemmConfig]:
  """Configs a sweep may try, the heuristic's first."""
  m, n, k, _ = GroupedGemmSizes.of(shapes)
  return fitted_candidates(choose_config(shapes), _SWEEP_CONFIGS, lambda c: _fit(c, m, n, k))


def e2m1_bytes_to_f32(packed):
  """Packed e2m1 bytes -> (even, odd) element values as float32, exactly
  `fp_formats.e2m1_to_f32` of the low / high nibbles, in fewer operations
  (this decode is the kernel's inner-loop ALU cost).

  An e2m1 code's three magnitude bits placed at bits 11..9 of an fp16 (sign
  at bit 15) form an fp16 whose value is the e2m1 value times 2**-14, for the
  normal codes (exponent field e, mantissa bit m) and the subnormal code 1
  (fp16 subnormal 2**-15) alike. The fp16 -> fp32 conversion is exact, so a
  multiplication by 2**14 restores the value: 2 masks, 2 shifts, an or, the
  conversion and a multiply per element, no compare or select.
  """
  x = packed.astype(jnp.int32)
  low = ((x & 0x7) << 9) | ((x & 0x8) << 12)
  high = ((x & 0x70) << 5) | ((x & 0x80) << 8)

  def value(bits):
    f16 = lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16)
    return f16.astype(jnp.float32) * jnp.float32(2.0**14)

  return value(low), value(high)


def dot_operand_dtype(config: GroupedGemmConfig | None = None):
  """The dtype the kernel's tensor-core dots take (the roofline judges the
  FLOPs against that peak): both operands are dequantized to bf16 before
  the dot, whatever the config."""
  del config
  return jnp.bfloat16


def work_list_length(m: int, e: int, block_m: int) -> int:
  """Static bound on the (tile, expert) items: every tile has one item, and
  each further item of a tile starts a new expert (experts increase along the
  valid rows), so at most min(E, M) - 1 extra."""
  return cdiv(m, block_m) + max(min(e, m), 1) - 1


def build_work_list(expert_ids: jax.Array, num_experts: int, block_m: int):
  """(tile, expert, first) int32 arrays of `work_list_length` entries.

  An item starts at each valid row whose (tile, expert) differs from the
  last valid row before it, and at the first row of a tile with no valid
  row (expert -1). `first` marks the first item of each tile, which also
  zeroes the tile's -1 rows. Unused entries are (0, -1, 0): no-ops.
  """
  m = expert_ids.shape[0]
  length = work_list_length(m, num_experts, block_m)
  num_tiles = cdiv(m, block_m)
  rows = jnp.arange(m, dtype=jnp.int32)
  tile = rows // block_m
  valid = expert_ids >= 0
  # Composite key (tile, expert), increasing along the valid rows; 0 = none.
  key = jnp.where(valid, tile * (num_experts + 1) + expert_ids + 1, 0)
  last_key = lax.cummax(key)
  prev_key = jnp.concatenate([jnp.zeros((1,), jnp.int32), last_key[:-1]])
  starts = valid & (key != prev_key)
  first_in_tile = prev_key < tile * (num_experts + 1) + 1  # no valid row earlier in the tile
  padded = jnp.zeros((num_tiles * block_m,), bool).at[:m].set(valid)
  tile_has_valid = padded.reshape(num_tiles, block_m).any(axis=1)
  empty_tile_start = (rows % block_m == 0) & ~tile_has_valid[tile]
  event = starts | empty_tile_start
  pos = jnp.where(event, jnp.cumsum(event.astype(jnp.int32)) - 1, length)
  item_tile = jnp.zeros((length,), jnp.int32).at[pos].set(tile, mode="drop")
  item_expert = jnp.full((length,), -1, jnp.int32).at[pos].set(
      jnp.where(valid, expert_ids, -1), mode="drop")
  item_first = jnp.zeros((length,), jnp.int32).at[pos].set(
      (empty_tile_start | (starts & first_in_tile)).astype(jnp.int32), mode="drop")
  return item_tile, item_expert, item_first


def _grouped_gemm_kernel(tile_ref, expert_ref, first_ref, ids_ref, a_ref, a_scale_ref, b_ref,
                         b_scale_ref, c_ref, *, m: int, n: int, k: int, block_m: int,
                         block_n: int, block_k: int):
  # Whole-array refs: a/a_scale/ids [M, ...], b/b_scale [E, N, ...], c [M, N];
  # the work-list refs have one entry per item.
  item = pl.program_id(1)
  tile = tile_ref[item]
  expert = expert_ref[item]
  first = first_ref[item] != 0
  n0 = pl.program_id(0) * block_n
  row0 = tile * block_m

  rows = row0 + lax.broadcasted_iota(jnp.int32, (block_m,), 0)
  rows_c = jnp.minimum(rows, m - 1)            # clamped: loads need no mask
  ids = jnp.where(rows < m, ids_ref[rows_c], -2)
  cols = n0 + lax.broadcasted_iota(jnp.int32, (block_n,), 0)
  cols_c = jnp.minimum(cols, n - 1)
  col_ok = (cols < n)[None, :]
  a_rows = rows_c[:, None]                                        # [block_m, 1]
  b_rows = cols_c[:, None]                                        # [block_n, 1]
  k_in_group = lax.broadcasted_iota(jnp.int32, (1, GROUP), 1)       # [1, 32]
  byte_in_group = lax.broadcasted_iota(jnp.int32, (1, GROUP // 2), 1)  # [1, 16]
  groups_per_step = block_k // GROUP

  def step(kk, acc):
    # One block_k step = block_k / 32 scale groups, unrolled: within a group
    # both operands have one scale per row, so scales are row vectors.
    for g in range(groups_per_step):
      group = kk * groups_per_step + g
      # Activations [block_m, 32]: fp8 bytes, times 2^(a_scale - 127), -> bf16.
      a_raw = lax.bitcast_convert_type(a_ref[a_rows, group * GROUP + k_in_group], jnp.float8_e4m3fn)
      a_scale = ue8m0_to_f32(a_scale_ref[a_rows, group])          # [block_m, 1]
      a_op = (a_raw.astype(jnp.float32) * a_scale).astype(jnp.bfloat16)
      # Weights [block_n, 16] packed bytes -> even k (low nibbles) and odd k
      # (high nibbles), times 2^(b_scale - 127), interleaved back to k order.
      packed = b_ref[expert, b_rows, group * (GROUP // 2) + byte_in_group]
      b_scale = ue8m0_to_f32(b_scale_ref[expert, b_rows, group])  # [block_n, 1]
      low, high = e2m1_bytes_to_f32(packed)
      b_even = (low * b_scale).astype(jnp.bfloat16)
      b_odd = (high * b_scale).astype(jnp.bfloat16)
      b_op = jnp.stack([b_even, b_odd], axis=-1).reshape(block_n, GROUP)
      acc += lax.dot_general(a_op, b_op, NT_DIMS, preferred_element_type=jnp.float32)
    return acc

  out_block = c_ref.at[pl.ds(row0, block_m), pl.ds(n0, block_n)]
  pad_rows = (ids == -1)[:, None] & first

  @pl.when(expert >= 0)
  def _compute():
    acc = lax.fori_loop(0, k // block_k, step, jnp.zeros((block_m, block_n), jnp.float32))
    mine = (ids == expert)[:, None]
    plgpu.store(out_block, jnp.where(mine, acc, 0.0).astype(c_ref.dtype),
                mask=(mine | pad_rows) & col_ok)

  @pl.when((expert < 0) & first)
  def _zero_padding_tile():
    plgpu.store(out_block, jnp.zeros((block_m, block_n), c_ref.dtype), mask=pad_rows & col_ok)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def grouped_gemm_fp8_fp4(a: jax.Array, a_scale: jax.Array, b: jax.Array, b_scale: jax.Array,
                         expert_ids: jax.Array, *, config: GroupedGemmConfig | None = None,
                         interpret: bool | None = None) -> jax.Array:
  """C [M, N] bf16 of the FP8 x FP4 m-grouped GEMM (module docstring).

  a [M, K] float8_e4m3fn, a_scale [M, K/32] uint8, b [E, N, K/2] uint8,
  b_scale [E, N, K/32] uint8, expert_ids [M] int32. `config=None` picks
  `choose_config`; a given config is fitted to the problem. `interpret=None`
  interprets when no GPU is present.
  """
  m, k = a.shape
  e, n, k_packed = b.shape
  if k % GROUP or k_packed * 2 != k:
    raise ValueError(f"K={k} must be a multiple of {GROUP} and b [E, N, K/2], got b {b.shape}")
  if a_scale.shape != (m, k // GROUP) or b_scale.shape != (e, n, k // GROUP) or expert_ids.shape != (m,):
    raise ValueError(f"bad shapes: a_scale {a_scale.shape}, b_scale {b_scale.shape}, "
                     f"expert_ids {expert_ids.shape} for M={m}, E={e}, N={n}, K={k}")
  if m == 0:
    return jnp.zeros((0, n), jnp.bfloat16)
  shapes = {"a": a, "b": b}
  config = _fit(config or choose_config(shapes), m, n, k)
  item_tile, item_expert, item_first = build_work_list(expert_ids.astype(jnp.int32), e, config.block_m)
  num_items = item_tile.shape[0]
  # fp8 travels as its bytes; the kernel bitcasts them back (masked or
  # gathered fp8 loads do not lower).
  a_bytes = lax.bitcast_convert_type(a, jnp.uint8)

  def whole(x):
    return pl.BlockSpec(x.shape, lambda j, i, nd=x.ndim: (0,) * nd)

  operands = (item_tile, item_expert, item_first, expert_ids.astype(jnp.int32), a_bytes, a_scale, b, b_scale)
  kernel = functools.partial(_grouped_gemm_kernel, m=m, n=n, k=k, block_m=config.block_m,
                             block_n=config.block_n, block_k=config.block_k)
  return common.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
      grid=(cdiv(n, config.block_n), num_items),
      in_specs=[whole(x) for x in operands],
      out_specs=pl.BlockSpec((m, n), lambda j, i: (0, 0)),
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=resolve_interpret(interpret),
      name="grouped_gemm_fp8_fp4",
  )(*operands)
