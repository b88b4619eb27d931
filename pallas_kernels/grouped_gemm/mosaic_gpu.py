"""FP8 x FP4 m-grouped GEMM (DeepSeek MoE experts) on Mosaic GPU (Hopper).

The contract of the Triton kernel (`pallas_kernels.grouped_gemm.triton`):

    C[m, n] = sum_k a[m,k] 2^(a_scale[m,k//32]-127) * e2m1(b[e,n,k]) 2^(b_scale[e,n,k//32]-127)

with `e = expert_ids[m]`, rows in any order, a row whose id is outside
[0, E) is 0; C bf16, fp32 accumulation. This kernel takes N a multiple of
64 (the width of C's store tiles; `Unsupported` otherwise, so
`backend="pallas"` falls back to Triton).

Folded scales, as the Triton kernel's prefill (`triton.fold_operands`, the
same references and the same fallback rule): both operands are f16 values
carrying their UE8M0 scale relative to their row's largest over K, `hi`:
an activation group d bytes below its row's `hi` is `e4m3 x 2^(7 - d)`, a
weight group `e2m1 x 2^(9 - d)`; every such product is exact in fp32, so
one f16 wgmma accumulation runs over all of K and the result is scaled
once by `2^(a_hi - 135) 2^(b_hi - 135)`. A unit whose rows do not all fold
(a row with a wider spread, a byte 0 or 255; `hi = -1`) runs the same
activations and the weights without their fold (e2m1 values times 2^-6)
one 32-k scale group per wgmma, each group's product promoted into an
fp32 accumulator times its two scales (`ue8m0_to_f32`: byte 0 gives 0,
byte 255 inf, as the Triton kernel's fp8 path; an activation row that
folds has the scale that undoes its fold in every group, one that does
not its own bytes, `activation_operand`), and the 2^6 restored at the
end.

Work list (XLA, before the launch; `work_list`): the rows are taken in
their own order and cut into items: runs of consecutive rows with one
key (the expert id, E for an invalid id), each run in pieces of up to
`block_m` rows. Rows grouped by expert (DeepGEMM's contiguous layout, the
records') make one run per expert; rows in any other order stay correct,
in more, smaller items. Items of invalid rows write zeros. The weights'
scale bytes of the experts the rows use are gathered and transposed to
[experts, K/32, N] (`expert_scales`; TMA cannot read a weight row's
scale bytes at K = 2304, whose rows are 72 bytes apart, and the kernel
wants each group's bytes of 64 rows as one vector); the fold references
are those of `triton.fold_operands`' rule, and each (item, N tile) unit
gets one flag: fold or not. The activations are converted once, to the
wgmma's f16 operand (`activation_operand`: folded, in the permuted k
order, [K/32, M, 32] by scale group; a pass over M x K bytes, which every
N tile's units read again): the kernel only decodes weights.

Structure: a persistent grid of `config.grid` CTAs (the SM count); CTA p
takes the units p, p + grid, ... of the (item, N tile) list, item-major
(the CTAs running together share an item's activation rows and an expert's
weights in L2). Three warpgroups:

- warpgroup 2, the producer (`setmaxnreg` down to `PRODUCER_REGISTERS`):
  per 64-k step of a unit, six TMA copies into ring slot `g % stages`:
  the packed weights `[block_n, 16]` byte pairs, their scale bytes
  `[2, block_n]` and fold references `[block_n]`, the f16 activations
  `[2, block_m, 32]` (the wgmma's B operand, one tile per scale group;
  `block_m` rows from the item's first: the rows past the item are
  computed and never stored), their promotion scale bytes and fold
  references.
- warpgroups 0 and 1, the consumers: each decodes its `block_n / 2`
  weight rows, 64 at a time, e2m1 -> e4m3 -> f16 times the multiplier,
  in registers in the wgmma layout: the A operand of
  `wgmma m64n{block_m}k16` (register A needs no shared-memory round trip
  for the weights). Compiled, the wgmmas of a step run while the next
  step decodes. The CPU interpreter's wgmma reads shared memory only, so
  in interpret mode the decoded weights go through a per-consumer tile
  first; and it keeps a `RefUnion`'s views apart, so there the activation
  tiles are one view (below).
- the activation tiles: TMA writes them through a 1-row-tiled view
  (`ACT_ROW_TRANSFORMS`), since Mosaic GPU tiles a copy's rows by its
  shared-memory tiling and an item may start at any row; the wgmmas read
  them through the 8-row view (`GROUP_TRANSFORMS`) of the same bytes (a
  `RefUnion`: each view starts at its union's first byte; with 32-column
  tiles both views lay a group out as rows of 64 bytes under the same
  64-byte swizzle).
- epilogue: the accumulator is C^T (`[64 weight rows, block_m rows]`):
  each consumer stores it transposed into a `(8, 64)`-tiled tile, reads
  it back in C's orientation into a 1-row-tiled tile, and TMA-stores the
  item's rows (a ladder of power-of-two row counts: TMA boxes are static)
  for its `block_n / 2` columns.

The k order inside a 32-k group is permuted, the same on both operands
(a dot does not depend on the order of k): column `8i + j` holds k = 4j + i
(`permute_group`). A thread of the wgmma register layout holds columns
(2c, 2c + 1) of each 8-column tile: the byte pairs it loads hold k
4j..4j+3, so each nibble position i becomes one 8-column tile without
moving data between threads.

Synchronization (interpret mode does not check asynchrony; this argument
is what makes the kernel correct on the GPU):

- Ring position. Producer and consumers walk the same units (from the same
  work list and grid) and the same steps: a unit of a valid item has
  `cdiv(K, 64)` steps, one of invalid rows none; the CTA's g-th step is in
  slot g % stages, use u = g // stages.
- `loaded[s]` (6 arrivals, one per TMA copy of a step) completes phase u
  once use u's data has landed; both consumers wait on it before reading
  the slot (the TMA writes and the wgmma reads of the activation tiles
  are both in the async proxy).
- `empty[s]` (2 arrivals, one per consumer) guards the slot's reuse: a
  consumer arrives once the wgmmas that read the slot's activation tile
  have completed (`wgmma_wait` with the next step's wgmmas in flight, or
  0 at the unit's end) and it has read the slot's staged weights, scales
  and references (before issuing those wgmmas; the epilogue's references
  before the last release, then `commit_smem()`: the generic-proxy reads
  ordered before the producer's next TMA into the slot, a race the
  interpreter's detector reported without it). The producer waits on `empty[s]` before
  reusing slot s for g >= stages, and at the end drains the last release
  of every slot it waited on (`drain_releases`).
- Epilogue tiles are each consumer's own (its columns): before writing
  them a consumer waits for its previous TMA stores to have read them
  (`wait_smem_to_gmem(0, wait_read_only=True)`); `commit_smem()` between
  the transposed store and the read back, and before the TMA stores.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import llvm

from pallas_kernels.grouped_gemm import triton
from pallas_kernels.grouped_gemm.config import MosaicGroupedGemmConfig
from pallas_kernels.shared import device
from pallas_kernels.shared import mosaic_gpu_compat as compat
from pallas_kernels.shared.common import cdiv, resolve_interpret
from pallas_kernels.shared.fp_formats import ue8m0_to_f32
from pallas_kernels.shared.kernel import Unsupported
from pallas_kernels.shared.mosaic_gpu import (
  NUM_CONSUMERS,
  ROW_TRANSFORMS,
  TILE_COLS,
  WGMMA_TRANSFORMS,
  align_kib,
  consumer_registers,
  drain_releases,
  num_sms,
)

GROUP = triton.GROUP  # k values per UE8M0 scale byte (both operands)
STEP_K = 2 * GROUP  # k values a ring slot holds: two scale groups, one per consumer's activation share
TILE_ROWS = 64  # rows of the epilogue's tiles (a wgmma layout tile); `block_m` of them are used
HALF = 64  # weight rows of one wgmma (its M)
PAIRS = GROUP // 4  # byte pairs of one weight row and group
# Activation scale bytes a step stages per group: TMA boxes are at least 16 bytes wide.
MIN_SCALE_ROWS = 16
# The staged byte pairs: 1-row tiles keep Mosaic GPU from tiling them for
# its register loads.
STAGING_TRANSFORMS = (plgpu.TilingTransform((1, 8)),)  # pyright: ignore[reportAbstractUsage] (public API; a jax Protocol reads as abstract)
# The f16 operands in shared memory: 32-column (64-byte) tiles, one per scale group.
GROUP_TRANSFORMS = (plgpu.TilingTransform((8, GROUP)), plgpu.SwizzleTransform(2 * GROUP))  # pyright: ignore[reportAbstractUsage] (public API; a jax Protocol reads as abstract)
# The same bytes in 1-row tiles: a group's rows are one 64-byte tile row
# either way, so this view and GROUP_TRANSFORMS' lay out a [rows, 32] tile
# alike; a TMA copy into this view may start at any row (Mosaic GPU asks an
# 8-row tiling for starts that are multiples of 8).
ACT_ROW_TRANSFORMS = (plgpu.TilingTransform((1, GROUP)), plgpu.SwizzleTransform(2 * GROUP))  # pyright: ignore[reportAbstractUsage] (public API; a jax Protocol reads as abstract)
# The producer only issues copies; the consumers decode and hold the
# accumulators (docs/perf/moe_kernels.md, the compile).
PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = consumer_registers(PRODUCER_REGISTERS)
COPIES_PER_STEP = 6
# Test-only sync faults (`_launch(fault=...)`): each breaks one rule of the
# synchronization argument so a test can show the interpreter catches it.
FAULTS = ("release_once", "staged_short")
# Fold constants: the Triton kernel's (one rule for both backends).
FOLD_A_EXPONENT = triton.FOLD_A_EXPONENT
FOLD_B_EXPONENT = triton.FOLD_B_EXPONENT
FOLD_UNSHIFT = triton.FOLD_UNSHIFT
E2M1_E4M3_EXPONENT = triton.E2M1_E4M3_EXPONENT


@dataclasses.dataclass(frozen=True)
class Sizes:
  m: int
  n: int
  k: int
  experts: int

  @classmethod
  def of(cls, shapes: Mapping[str, Any]) -> Sizes:
    return cls(*triton.GroupedGemmSizes.of(shapes))


# ---------------------------------------------------------------------------
# Configs.


def shared_memory_bytes(config: MosaicGroupedGemmConfig, interpret: bool = False) -> int:
  """The scratch the kernel allocates, each buffer aligned to 1 KiB: per
  ring slot the weights' byte pairs, scale bytes and references, and the
  activations' f16 tile, promotion scale bytes and references; the two
  epilogue tiles; in interpret mode the decoded weights' tiles
  (`interpret`); and the barriers."""
  bm, bn = config.block_m, config.block_n
  slot = [bn * PAIRS * 2 * 2, 2 * bn, 4 * bn, 2 * bm * GROUP * 2, 2 * _scale_rows(config), 4 * bm]
  epilogue = [TILE_ROWS * bn * 2, TILE_ROWS * bn * 2]
  staged_weights = [NUM_CONSUMERS * _halves(config) * 2 * HALF * GROUP * 2] if interpret else []
  return (
    config.stages * sum(map(align_kib, slot)) + sum(map(align_kib, epilogue + staged_weights)) + 8 * 2 * config.stages
  )


def _scale_rows(config: MosaicGroupedGemmConfig) -> int:
  """Activation rows whose scale bytes a step stages (`block_m` of them used)."""
  return max(config.block_m, MIN_SCALE_ROWS)


def _halves(config: MosaicGroupedGemmConfig) -> int:
  """64-row wgmma halves of one consumer's weight rows."""
  return config.block_n // NUM_CONSUMERS // HALF


def fits(config: MosaicGroupedGemmConfig) -> bool:
  return shared_memory_bytes(config) <= device.SHARED_MEMORY_PER_BLOCK


# Rows per expert from which 64-row items pay (the wgmma's N): below, the
# rows of an expert fill a smaller tile; each weight decode then serves
# fewer products, but no padding rows are multiplied.
_BLOCK_M_ROWS = ((6, 8), (12, 16), (24, 32))


def _block_m(m: int, e: int) -> int:
  rows = cdiv(max(m, 1), max(min(e, m), 1))
  return next((bm for limit, bm in _BLOCK_M_ROWS if rows <= limit), 64)


def choose_config(shapes: Mapping[str, Any]) -> MosaicGroupedGemmConfig:
  """256 weight rows a unit (each consumer 2 x 64), the ring as deep as
  shared memory allows (at most 4), and items of `block_m` rows from the
  rows per expert: 8 at decode (one row an expert), 64 at prefill."""
  sizes = Sizes.of(shapes)
  config = MosaicGroupedGemmConfig(block_m=_block_m(sizes.m, sizes.experts))
  while not fits(config):
    config = dataclasses.replace(config, stages=config.stages - 1)
  return config


def candidate_configs(shapes: Mapping[str, Any]) -> list[MosaicGroupedGemmConfig]:
  """The heuristic's first, then the other item sizes and a 128-row unit."""
  chosen = choose_config(shapes)
  sweep = [chosen]
  sweep += [dataclasses.replace(chosen, block_m=bm) for bm in (8, 16, 32, 64)]
  sweep += [dataclasses.replace(chosen, block_n=128), dataclasses.replace(chosen, stages=chosen.stages - 1)]
  return [c for c in dict.fromkeys(sweep) if c.stages >= 2 and fits(c)]


def check_problem(n: int) -> None:
  """Raises `Unsupported` unless N is a multiple of 64 (C's store tiles)."""
  if n % TILE_COLS:
    raise Unsupported(f"N={n} must be a multiple of {TILE_COLS} for the Mosaic GPU grouped GEMM")


# CTAs of `grid=None` in interpret mode: the interpreter runs every CTA's
# warpgroups as threads, and the work list's size is only known at run time,
# so an SM count of CTAs would mostly find no unit and only cost time there.
INTERPRET_GRID = 4


def grid_size(config: MosaicGroupedGemmConfig, units: int, interpret: bool = False) -> int:
  """The persistent CTA count: `config.grid` (or the SM count;
  `INTERPRET_GRID` in interpret mode), at most the units' bound."""
  default = INTERPRET_GRID if interpret else num_sms()
  return max(1, min(config.grid or default, units))


# ---------------------------------------------------------------------------
# The work list (XLA, before the launch).


class WorkList(dict):
  """Named operands of the kernel's work list (`work_list`)."""


def _pad_to(x: jax.Array, axis: int, multiple: int, value: int = 0) -> jax.Array:
  extra = -x.shape[axis] % multiple
  if not extra:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def work_list(expert_ids: jax.Array, num_experts: int, block_m: int):
  """Items in row order: `items` int32 [4, M] whose column i is item i's
  (key, first row, rows, index of its expert in `experts`), the first
  `count` [1] columns used; `experts` int32 [min(E, M)], the distinct valid
  ids ascending (padded with E). An item is up to `block_m` consecutive rows
  of one key (the id, E for an id outside [0, E)); every row is in exactly
  one item."""
  m = expert_ids.shape[0]
  ids = expert_ids.astype(jnp.int32)
  key = jnp.where((ids >= 0) & (ids < num_experts), ids, num_experts)
  row = jnp.arange(m, dtype=jnp.int32)
  run_start = (row == 0) | (key != jnp.roll(key, 1))
  run_first = lax.cummax(jnp.where(run_start, row, 0))
  starts_item = run_start | ((row - run_first) % block_m == 0)
  count = jnp.sum(starts_item.astype(jnp.int32))
  (first,) = jnp.nonzero(starts_item, size=m, fill_value=m)
  first = first.astype(jnp.int32)
  end = jnp.concatenate([first[1:], jnp.full((1,), m, jnp.int32)])
  rows = jnp.where(first < m, jnp.minimum(end, m) - first, 0)
  item_key = jnp.where(first < m, key[jnp.minimum(first, m - 1)], num_experts)
  slots = min(num_experts, m)
  experts = jnp.unique(jnp.where(key < num_experts, key, num_experts), size=slots + 1, fill_value=num_experts)
  experts = experts[:slots].astype(jnp.int32)  # E (invalid) sorts last: at most `slots` valid ids
  used = jnp.minimum(jnp.searchsorted(experts, item_key), slots - 1).astype(jnp.int32)
  items = jnp.stack([item_key, first, rows, used])
  item_of_row = jnp.cumsum(starts_item.astype(jnp.int32)) - 1
  return items, count.reshape(1), experts, item_of_row


def expert_scales(b_scale: jax.Array, experts: jax.Array, block_n: int):
  """The used experts' weight scale bytes transposed, uint8 [U, K/32, Np],
  their fold references int32 [U, Np] (N padded to a multiple of 16 for
  TMA: the padding's bytes and references never meet a nonzero weight),
  and whether each (expert, N tile) folds, bool [U, N tiles]."""
  num_experts, n, _ = b_scale.shape
  scales = b_scale[jnp.minimum(experts, num_experts - 1)]  # [U, N, G]
  b_fold = triton._fold_reference(scales, triton.FOLD_B_MAX_SHIFT)  # [U, N]
  tiles = cdiv(n, block_n)
  tile_fold = jnp.min(_pad_to(b_fold, 1, block_n, 127).reshape(b_fold.shape[0], tiles, block_n), axis=2) >= 0
  scales_t = _pad_to(jnp.swapaxes(scales, 1, 2), 2, 16)
  return scales_t, _pad_to(b_fold, 1, 16, 127), tile_fold


def _operands(a, a_scale, b, b_scale, expert_ids, config: MosaicGroupedGemmConfig):
  """Everything the kernel reads, in its argument order."""
  m, k = a.shape
  num_experts, n, _ = b.shape
  items, count, experts, item_of_row = work_list(expert_ids, num_experts, config.block_m)
  scales_t, b_fold, tile_fold = expert_scales(b_scale, experts, config.block_n)
  a16, a_promote, a_fold = activation_operand(a, a_scale)
  item_fold = jax.ops.segment_min(a_fold, item_of_row, num_segments=m) >= 0
  unit_fold = (item_fold[:, None] & tile_fold[items[3]]).astype(jnp.int32)  # [M item slots, N tiles]
  return (
    items,
    count,
    unit_fold,
    a16,
    _pad_to(a_promote, 1, 16),
    _pad_to(a_fold, 0, 16, 127),
    triton.byte_pairs(b),
    scales_t,
    b_fold,
  )


def activation_operand(a: jax.Array, a_scale: jax.Array):
  """The activations as the kernel's wgmma operand, converted once before
  the launch (a pass over M x K bytes; each of the N tiles' units reads its
  rows again): f16 [K/32, M, 32] by scale group, in the permuted k order
  (`permute_group`), each row folded against its reference
  (`e4m3 x 2^(7 - d)`, exact) or, where it does not fold, the e4m3 values
  themselves; uint8 [K/32, M], the scale bytes the promoted fallback
  multiplies each group's product by: a folded row's 2^(hi - 134) for every
  group (what undoes its fold), another row's own bytes; and the rows'
  fold references, int32 [M] (-1: does not fold)."""
  m, k = a.shape
  a_fold = triton._fold_reference(a_scale, triton.FOLD_A_MAX_SHIFT)  # [M]
  folds = a_fold[:, None] >= 0
  shift = jnp.where(folds, FOLD_A_EXPONENT - (a_fold[:, None] - a_scale.astype(jnp.int32)), 0)  # [M, K/32]
  values = a.astype(jnp.float32).reshape(m, k // GROUP, GROUP) * triton.f32_pow2(shift)[:, :, None]
  a16 = jnp.swapaxes(permute_group(values.reshape(m, k)).reshape(m, k // GROUP, GROUP), 0, 1).astype(jnp.float16)
  promote = jnp.where(folds, a_fold[:, None] - FOLD_A_EXPONENT, a_scale.astype(jnp.int32)).astype(jnp.uint8)
  return a16, promote.T, a_fold


# ---------------------------------------------------------------------------
# Decoding (jnp on values in the wgmma register layout).


def f16_pow2(e):
  """2^e as f16 for int32 e in [-24, 15] (exact)."""
  return triton.f32_pow2(e).astype(jnp.float16)


def _register_asm(array, ptx: str):
  """Four f16 arrays of `array`'s shape and wgmma layout from inline PTX
  run on each of its 32-bit registers (`ptx`: outputs $0..$3, f16x2 each;
  input $4): register r of result i is the asm's result i on register r,
  lane for lane."""
  shape = plgpu.ShapeDtypeStruct(array.shape, jnp.dtype(jnp.float16), layout=plgpu.Layout.WGMMA)

  def decode(_, array):
    i32, f16 = ir.IntegerType.get_signless(32), ir.F16Type.get()
    struct = ir.Type.parse("!llvm.struct<(i32, i32, i32, i32)>")
    outs = [np.empty_like(array.registers) for _ in range(4)]
    for index, reg in np.ndenumerate(array.registers):
      word = mgpu.utils.bitcast(reg, i32)
      result = llvm.inline_asm(struct, [word], ptx, "=r,=r,=r,=r,r")
      for i in range(4):
        outs[i][index] = mgpu.utils.bitcast(llvm.extractvalue(i32, result, [i]), ir.VectorType.get((2,), f16))
    return tuple(mgpu.FragmentedArray(_registers=o, _layout=array.layout, _is_signed=None) for o in outs)

  return list(plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,), return_type=(shape,) * 4)(decode)(array))


# The weights' decode of one 32-bit register (two byte pairs: pair p in
# bytes 2p, 2p + 1) into its four f16x2 registers, one per code position i
# (lane p: code i of pair p): the bytes reordered (b0, b2, b1, b3), the
# e4m3 bytes of the low and high nibbles (`fp_formats.e2m1_to_e4m3_bits`
# on all four bytes at once), then one `cvt.rn.f16x2.e4m3x2` per half.
E2M1_PAIRS_TO_F16_PTX = """{
.reg .b32 w, t, u, e, o;
.reg .b16 el, eh, ol, oh;
prmt.b32 w, $4, $4, 0x3120;
shl.b32 t, w, 2;
and.b32 t, t, 0x1C1C1C1C;
shl.b32 u, w, 4;
and.b32 u, u, 0x80808080;
or.b32 e, t, u;
shr.b32 t, w, 2;
and.b32 t, t, 0x1C1C1C1C;
and.b32 u, w, 0x80808080;
or.b32 o, t, u;
mov.b32 {el, eh}, e;
mov.b32 {ol, oh}, o;
cvt.rn.f16x2.e4m3x2 $0, el;
cvt.rn.f16x2.e4m3x2 $1, ol;
cvt.rn.f16x2.e4m3x2 $2, eh;
cvt.rn.f16x2.e4m3x2 $3, oh;
}"""


def _codes_to_f16(pairs):
  """The four code positions of byte pairs uint16 [rows, 8] as f16 arrays
  [rows, 8] (code i of each pair: the e2m1 value times 2^-6), in jnp."""
  parts = []
  for i in range(4):
    code = (pairs >> (4 * i)) & 0xF
    bits = ((code & 0x7) << 2) | ((code & 0x8) << 4)
    parts.append(lax.bitcast_convert_type(bits.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float16))
  return parts


def weights_to_f16(pairs, mult, ptx: bool = False):
  """One group of weights: byte pairs uint16 [rows, 8] (4 e2m1 codes each,
  k 4j..4j+3, the low nibble first) -> f16 [rows, 32] in the permuted k
  order (column 8i + j: code i of pair j), each the e2m1 value times 2^-6
  (the e4m3 decode, `fp_formats.e2m1_to_e4m3_bits`) times the rows'
  multipliers `mult` f16 [rows]. `ptx`: the compiled kernel's form
  (`E2M1_PAIRS_TO_F16_PTX`), the same values."""
  parts = _register_asm(pairs, E2M1_PAIRS_TO_F16_PTX) if ptx else _codes_to_f16(pairs)
  values = jnp.concatenate(parts, axis=1)
  return values * lax.broadcast_in_dim(mult, values.shape, [0])


def permute_group(x: jax.Array) -> jax.Array:
  """The kernel's k order of a [..., K] array (K a multiple of 32): in each
  32-k group, column 8i + j holds k = 4j + i. (Tests and docs only: the
  kernel decodes straight into it.)"""
  *lead, k = x.shape
  return x.reshape(*lead, k // GROUP, PAIRS, 4).swapaxes(-1, -2).reshape(*lead, k)


# ---------------------------------------------------------------------------
# Kernel.


def _kernel(
  items_gmem,
  count_gmem,
  fold_gmem,
  a_gmem,
  a_promote_gmem,
  a_fold_gmem,
  b_gmem,
  b_scale_gmem,
  b_fold_gmem,
  c_gmem,
  *,
  config: MosaicGroupedGemmConfig,
  n: int,
  k: int,
  experts: int,
  grid: int,
  interpret: bool,
  fault: str | None,
):
  bm, bn, stages = config.block_m, config.block_n, config.stages
  halves = _halves(config)
  scale_rows = _scale_rows(config)
  cols = bn // NUM_CONSUMERS  # output columns of one consumer
  n_tiles = cdiv(n, bn)
  k_steps = cdiv(k, STEP_K)
  cta = lax.axis_index("cta")
  units = count_gmem[0] * n_tiles
  my_units = lax.div(jnp.maximum(units - cta + grid - 1, 0), grid)

  def unit_of(j):
    """(key, first row, rows, used expert, N tile, fold) of this CTA's j-th unit."""
    v = cta + j * grid
    item, tile = lax.div(v, n_tiles), lax.rem(v, n_tiles)
    fields = [items_gmem[f, item] for f in range(4)]
    return (*fields, tile, fold_gmem[item, tile])

  def scoped(*refs):
    (w_smem, w_scale_smem, w_fold_smem, act, a_promote_smem, a_fold_smem, t_smem, o_smem) = refs[:8]
    act_rows_smem, act_smem = (act, act) if interpret else act
    a_regs_smem = refs[8] if interpret else None
    loaded, empty = refs[-2:]
    wg = lax.axis_index("wg")

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
      plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

      def unit(j, g):
        key, first, _, used, tile, _ = unit_of(j)
        n0 = tile * bn

        @pl.when(key < experts)
        def _():
          @pl.loop(0, k_steps)
          def _step(kk):
            step = g + kk
            slot = lax.rem(step, stages)

            @pl.when(step >= stages)
            def _():
              plgpu.barrier_wait(empty.at[slot])

            bar = loaded.at[slot]
            groups = pl.ds(2 * kk, 2)
            plgpu.copy_gmem_to_smem(
              b_gmem.at[key, pl.ds(n0, bn), pl.ds(kk * 2 * PAIRS, 2 * PAIRS)], w_smem.at[slot], bar
            )
            plgpu.copy_gmem_to_smem(b_scale_gmem.at[used, groups, pl.ds(n0, bn)], w_scale_smem.at[slot], bar)
            plgpu.copy_gmem_to_smem(b_fold_gmem.at[used, pl.ds(n0, bn)], w_fold_smem.at[slot], bar)
            plgpu.copy_gmem_to_smem(a_gmem.at[groups, pl.ds(first, bm)], act_rows_smem.at[slot], bar)
            plgpu.copy_gmem_to_smem(a_promote_gmem.at[groups, pl.ds(first, scale_rows)], a_promote_smem.at[slot], bar)
            plgpu.copy_gmem_to_smem(a_fold_gmem.at[pl.ds(first, bm)], a_fold_smem.at[slot], bar)

        return g + jnp.where(key < experts, k_steps, 0)

      total = lax.fori_loop(0, my_units, unit, jnp.int32(0))
      drain_releases(total, stages, empty)

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
      plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
      row_layout, col_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
      my_cols = wg * cols

      def weight_rows(h):
        return pl.ds(my_cols + h * HALF, HALF)

      def load(ref, layout=plgpu.Layout.WGMMA):
        return plgpu.load(ref, layout=layout, optimized=False)

      def decode_weights(slot, h, group, fold):
        rows = weight_rows(h)
        if fold:
          b_hi = plgpu.load(w_fold_smem.at[slot, rows], layout=row_layout)
          byte = plgpu.load(w_scale_smem.at[slot, group, rows], layout=row_layout).astype(jnp.int32)
          mult = f16_pow2(FOLD_B_EXPONENT - (b_hi - byte))
        else:
          mult = plgpu.layout_cast(jnp.ones((HALF,), jnp.float16), row_layout)
        pairs = load(w_smem.at[slot, rows, pl.ds(group * PAIRS, PAIRS)])
        return weights_to_f16(pairs, mult, ptx=not interpret)

      def operand(h, group, value):
        """The wgmma's A operand: the value itself when compiled; in
        interpret mode a shared-memory copy (the interpreter's wgmma reads
        shared memory only)."""
        if not interpret:
          return value
        assert a_regs_smem is not None
        ref = a_regs_smem.at[wg, h, group]
        ref[...] = value
        plgpu.commit_smem()
        return ref

      def activations(slot, group):
        return act_smem.at[slot, group].T

      def release(step):
        plgpu.barrier_arrive(empty.at[lax.rem(step, stages)])

      def folded(g, accs):
        """The unit's K loop, folded: one accumulation over K per half."""

        def body(kk, carry):
          step = g + kk
          slot = lax.rem(step, stages)
          plgpu.barrier_wait(loaded.at[slot])
          ops = [[operand(h, grp, decode_weights(slot, h, grp, True)) for grp in range(2)] for h in range(halves)]
          for h in range(halves):
            for grp in range(2):
              plgpu.wgmma(accs[h], ops[h][grp], activations(slot, grp))
          # The previous step's wgmmas have completed once this step's are
          # all that is in flight.
          plgpu.wgmma_wait(2 * halves)
          pl.when(kk > 0)(lambda: release(step - 1))
          return carry

        lax.fori_loop(0, k_steps, body, 0)
        plgpu.wgmma_wait(0)
        return [acc[...] for acc in accs]

      def promoted(g):
        """The unit's K loop without the fold: each group's product promoted
        with its scales."""

        def body(kk, accs):
          step = g + kk
          slot = lax.rem(step, stages)
          plgpu.barrier_wait(loaded.at[slot])
          out = []
          for h in range(halves):
            acc = accs[h]
            for grp in range(2):
              a_op = operand(h, grp, decode_weights(slot, h, grp, False))

              def product(part, a_op=a_op, grp=grp):
                plgpu.wgmma(part, a_op, activations(slot, grp))
                return part[...]

              part = pl.run_scoped(product, plgpu.ACC((HALF, bm), jnp.float32))  # pyright: ignore[reportPrivateImportUsage] (public Pallas alias)
              b_scale = ue8m0_to_f32(plgpu.load(w_scale_smem.at[slot, grp, weight_rows(h)], layout=row_layout))
              a_scale = ue8m0_to_f32(plgpu.load(a_promote_smem.at[slot, grp, pl.ds(0, bm)], layout=col_layout))
              scale = lax.broadcast_in_dim(b_scale, part.shape, [0]) * lax.broadcast_in_dim(a_scale, part.shape, [1])
              acc = acc + part * scale
            out.append(acc)
          pl.when(kk < k_steps - 1)(lambda: release(step))
          return out

        zero = plgpu.layout_cast(jnp.zeros((HALF, bm), jnp.float32), plgpu.Layout.WGMMA)
        accs = lax.fori_loop(0, k_steps, body, [zero] * halves)
        return [acc * jnp.float32(2.0**E2M1_E4M3_EXPONENT) for acc in accs]

      def store_rows(first, rows, n0):
        """The item's `rows` rows of the 1-row-tiled tile to C (a ladder of
        power-of-two row counts)."""
        plgpu.commit_smem()
        size = bm
        while size >= 1:

          @pl.when((rows & size) != 0)
          def _(size=size):
            done = rows & -(2 * size)  # the rows the larger pieces stored
            plgpu.copy_smem_to_gmem(
              o_smem.at[wg].at[pl.ds(done, size)],
              c_gmem.at[pl.ds(first + done, size), pl.ds(n0 + my_cols, cols)],
            )

          size //= 2

      def epilogue(accs, slot, first, rows, n0, fold):
        """`accs` (None: an item of invalid rows, zeros) scaled by the
        fold's unit factors (read from the unit's last slot, which is then
        released) into C's rows of the item."""
        if accs is not None:
          outs = accs
          if fold:
            a_hi = plgpu.load(a_fold_smem.at[slot], layout=col_layout)
            a_unit = lax.broadcast_in_dim(triton.f32_pow2(a_hi - FOLD_UNSHIFT), accs[0].shape, [1])
            outs = []
            for h, acc in enumerate(accs):
              b_hi = plgpu.load(w_fold_smem.at[slot, weight_rows(h)], layout=row_layout)
              outs.append(acc * lax.broadcast_in_dim(triton.f32_pow2(b_hi - FOLD_UNSHIFT), acc.shape, [0]) * a_unit)
          # The references were read through the generic proxy; the
          # producer's next TMA (async proxy) into the slot must come after.
          plgpu.commit_smem()
          plgpu.barrier_arrive(empty.at[slot])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous unit's stores have read the tiles
        if accs is None:
          o_smem[wg] = plgpu.layout_cast(jnp.zeros((TILE_ROWS, cols), c_gmem.dtype), plgpu.Layout.WGMMA)
        else:
          for h, out in enumerate(outs):
            t_smem.at[wg, pl.ds(0, bm), pl.ds(h * HALF, HALF)].T[...] = out.astype(c_gmem.dtype)
          plgpu.commit_smem()
          o_smem[wg] = plgpu.load(t_smem.at[wg], layout=plgpu.Layout.WGMMA)
        store_rows(first, rows, n0)

      def unit(j, g):
        key, first, rows, _, tile, fold_flag = unit_of(j)
        n0 = tile * bn
        fold = fold_flag > 0
        last = lax.rem(g + k_steps - 1, stages)

        @pl.when(key == experts)
        def _zeros():
          epilogue(None, None, first, rows, n0, fold)

        @pl.when((key < experts) & fold)
        def _folded():
          accs = pl.run_scoped(lambda *accs: folded(g, list(accs)), *[plgpu.ACC((HALF, bm), jnp.float32)] * halves)  # pyright: ignore[reportPrivateImportUsage] (public Pallas alias)
          epilogue(accs, last, first, rows, n0, True)

        @pl.when((key < experts) & ~fold)
        def _promoted():
          epilogue(promoted(g), last, first, rows, n0, False)

        return g + jnp.where(key < experts, k_steps, 0)

      lax.fori_loop(0, my_units, unit, jnp.int32(0))
      plgpu.wait_smem_to_gmem(0)

  # The activation tiles: TMA writes them through the 1-row view, the wgmmas
  # read them through the 8-row one (the same bytes). The interpreter keeps
  # a union's views apart and copies to any row of the 8-row view itself.
  act_tiles = plgpu.SMEM((stages, 2, bm, GROUP), jnp.float16, transforms=GROUP_TRANSFORMS)
  if not interpret:
    act_rows = plgpu.SMEM((stages, 2, bm, GROUP), jnp.float16, transforms=ACT_ROW_TRANSFORMS)
    act_tiles = plgpu.RefUnion(act_rows, act_tiles)
  slot_buffers = [
    plgpu.SMEM((stages, bn, 2 * PAIRS), jnp.uint16, transforms=STAGING_TRANSFORMS),
    plgpu.SMEM((stages, 2, bn), jnp.uint8),
    plgpu.SMEM((stages, bn), jnp.int32),
    act_tiles,
    plgpu.SMEM((stages, 2, scale_rows), jnp.uint8),
    plgpu.SMEM((stages, bm), jnp.int32),
  ]
  epilogue_buffers = [
    plgpu.SMEM((NUM_CONSUMERS, TILE_ROWS, bn // NUM_CONSUMERS), c_gmem.dtype, transforms=WGMMA_TRANSFORMS),
    plgpu.SMEM((NUM_CONSUMERS, TILE_ROWS, bn // NUM_CONSUMERS), c_gmem.dtype, transforms=ROW_TRANSFORMS),
  ]
  staged_weights = [plgpu.SMEM((NUM_CONSUMERS, halves, 2, HALF, GROUP), jnp.float16, transforms=GROUP_TRANSFORMS)]
  pl.run_scoped(
    scoped,
    *slot_buffers,
    *epilogue_buffers,
    *(staged_weights if interpret else []),
    plgpu.Barrier(num_arrivals=COPIES_PER_STEP - (fault == "staged_short"), num_barriers=stages),
    plgpu.Barrier(num_arrivals=1 if fault == "release_once" else NUM_CONSUMERS, num_barriers=stages),
    collective_axes="wg",
  )


def _launch(a, a_scale, b, b_scale, expert_ids, config: MosaicGroupedGemmConfig, interpret: bool, fault=None):
  """The launch; `fault` (tests only, one of `FAULTS`) breaks the
  synchronization on purpose."""
  if fault is not None and fault not in FAULTS:
    raise ValueError(f"fault must be None or one of {FAULTS}, got {fault!r}")
  m, k = a.shape
  num_experts, n, _ = b.shape
  operands = _operands(a, a_scale, b, b_scale, expert_ids, config)
  grid = grid_size(config, m * cdiv(n, config.block_n), interpret)
  kernel = compat.kernel(
    functools.partial(
      _kernel, config=config, n=n, k=k, experts=num_experts, grid=grid, interpret=interpret, fault=fault
    ),
    out_type=jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
    grid=(grid,),
    grid_names=("cta",),
    num_threads=NUM_CONSUMERS + 1,
    thread_name="wg",
    name=__name__,
    interpret=interpret,
  )
  return kernel(*operands)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def grouped_gemm_fp8_fp4(
  a: jax.Array,
  a_scale: jax.Array,
  b: jax.Array,
  b_scale: jax.Array,
  expert_ids: jax.Array,
  *,
  config: MosaicGroupedGemmConfig | None = None,
  interpret: bool | None = None,
) -> jax.Array:
  """C [M, N] bf16 of the FP8 x FP4 m-grouped GEMM: the contract of
  `triton.grouped_gemm_fp8_fp4`, for N a multiple of 64 (`Unsupported`
  otherwise). `config=None` picks `choose_config`; `interpret=None`
  interprets (Mosaic GPU's CPU interpreter) when no GPU is present."""
  triton.check_operands(a, a_scale, b, b_scale, expert_ids)
  m, _ = a.shape
  _, n, _ = b.shape
  check_problem(n)
  if m == 0 or n == 0:
    return jnp.zeros((m, n), jnp.bfloat16)
  config = config or choose_config({"a": a, "b": b})
  return _launch(a, a_scale, b, b_scale, expert_ids, config, resolve_interpret(interpret))
