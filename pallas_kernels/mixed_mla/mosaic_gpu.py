"""Mixed FP8/FP4 MLA decode (SPEC 4.10) on Mosaic GPU (Hopper): all 64 heads
of a sequence in one wgmma row tile, a producer warpgroup gathering and
dequantizing the token records, two consumer warpgroups on wgmma.

Contract: the Triton kernel's (`pallas_kernels.mixed_mla.triton`): q
`[B, H, D]` bf16, the FP8 window cache `kv_fp8 [N8, P8, 1, 528]` and the FP4
compressed cache `kv_fp4 [N4, P4, 1, 288]` (uint8 records), their flat row
indices (anything outside `[0, rows)` is an invalid slot: it contributes
nothing and its row is never read), a scalar `sm_scale` (may be traced),
`attn_sink [H]` f32 in the denominator only. Returns `(out [B, H, D] bf16,
lse [B, H] f32 natural log, no sink)`; a row with no valid slot gives 0 and
+inf. This kernel takes H a multiple of 64 and D = 512 (`check_supported`;
`Unsupported` otherwise, so `backend="pallas"` falls back to Triton).

The dims in a permuted order: the Mosaic GPU register layout of a wgmma
operand gives each thread pairs of adjacent columns, but a packed FP4 byte
holds two adjacent dims: splitting its nibbles into one register pair
would interleave two tiles, which the layout cannot express. So the key
tiles hold each 64-dim chunk as its 32 even dims, then its 32 odd dims
(`permute_dims`): the low nibbles of the chunk's 32 bytes, then the high
ones; the FP8 chunk the same, from the low and high bytes of its 32 16-bit
words. Scores do not depend on the order of the dims (q is permuted alike,
outside the kernel); the output comes out permuted and is put back
(`unpermute_dims`), both small XLA transposes.

Structure: grid (H / 64, splits, B); a CTA walks the slot blocks of
`block_k` of one sequence: the FP8 window's blocks, then the FP4 ones
(`_slot_blocks`: one table, invalid slots set to -1), from the first to one
past the last block holding a valid index, or with `config.splits > 1` its
split's run of them, writing fp32 partials (normalized output, base-2 lse)
that the shared `split_kv.combine_splits` merges with the sink. Three
warpgroups:

- warpgroup 2, the producer (`setmaxnreg` `PRODUCER_REGISTERS`): Q (two
  halves), the sinks, the scales and the sequence's slot table once by
  TMA; per step, two TMAs per slot gather the records into an untiled
  staging buffer (FP8: 512 value bytes and the 16 scale bytes, as 16-bit
  words; FP4: 256 packed bytes and 32 scale bytes); an invalid slot copies
  a zero record instead, so every step makes `2 * block_k` copies. Then it
  dequantizes through its registers into the wgmma-tiled ring slot: FP8
  e4m3 values exactly in bf16 (unscaled; their per-128-dim f32 scales go to
  the slot's scale table), FP4 e2m1 values times their UE8M0 scales
  (exact: a power of two; the slot's scale table is then 1). The bit
  decoders are `shared.fp_formats`'; a record's scales come out of its
  staged row by a masked row reduction (one column of the staged tile).
- warpgroups 0 and 1, the consumers (`setmaxnreg` `CONSUMER_REGISTERS`):
  each computes the full scores, one wgmma accumulator per 128-dim scale
  chunk c, `S = sum_c scale_c * (Q_c K_c^T)` (both consumers compute it, so
  m and l agree), the masked online softmax in base 2, and for each of its
  own two 128-dim value chunks c, `O_c = O_c * correction + P_c V_c` with
  `P_c = p * scale_c` entering the wgmma as bf16 hi + lo terms (about 16
  significant bits: the FP4 outlier-scale test needs them), accumulated onto
  the rescaled output in its registers (`shared.mosaic_gpu.
  rescale_and_accumulate`). Consumer w owns value columns [256 w, 256 w +
  256) (in the permuted order, the same set of dims).
- epilogue: after a rendezvous (the other consumer's last S wgmma reads all
  of Q), each consumer writes its half through the Q buffer (or, split, an
  fp32 buffer aliasing Q and the ring) and stores it by TMA; consumer 0
  stores lse.

Synchronization (interpret mode does not check asynchrony), as in the
sparse MLA prefill kernel (`pallas_kernels.sparse_mla.mosaic_gpu`):

- `start` (5 arrivals: two Q halves, sinks, scales, slot table): every
  warpgroup waits on it once before reading any of them.
- `staged` (`2 * block_k` arrivals, the zero copies of invalid slots
  included) guards the staging buffer; only the producer waits on it, once
  per step. It reads the staged records (generic proxy) before issuing the
  next step's TMAs into them (async proxy): `commit_smem()` between them
  (a proxy fence and a warpgroup barrier) orders every thread's reads first.
- `ring_full[s]` (1 arrival: the producer, after `commit_smem()` made its
  stores of the ring slot and the slot's scale table visible) guards slot
  s's keys and scales; both consumers wait on it before reading either.
- `ring_empty[s]` (2 arrivals, one per consumer) guards reuse of both: a
  consumer arrives after its last P V wgmma of the step completed (its
  result was read) and its S wgmmas and scale loads before it. The
  producer waits on it before dequantizing step g >= stages into slot s,
  and at the end on the last release of every slot it waited on.
- Ring position and parity: step g is in slot g % stages; producer and
  consumers walk the same steps (from the same `limits` row), so use u of
  slot s completes phase u of `ring_full[s]` and `ring_empty[s]`, and each
  waiter waits on every phase in order.
- The slot table and sinks are written once, before `start` completes.
- `done` (2 arrivals): the consumers' rendezvous before the epilogue
  overwrites Q. P tiles (hi, lo) of consumer w are written by w only, after
  the wgmmas that read them completed, and made visible by `commit_smem()`.
  Consumer 0 alone writes the lse tile (`store_rows`).

What the CPU interpreter checks of this (docs/perf/mosaic_gpu.md, "Race
detector"; `tests/test_mixed_mla_mosaic.py` breaks the rules it sees): its
race detector, on in every test run, the rules it sees in the sparse MLA
kernel (`staged_late` among them) and, on the ring, the slot's scale
table (stored by the producer, loaded by the consumers); its barrier
checks, the arrival counts (`release_once`, `staged_short`). The keys in
the ring are read by wgmma only, which the detector does not order, and
wgmma asynchrony is not modelled: those rest on this argument.
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
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mixed_mla.caches import FP4_GROUP, MixedMlaSizes, check_inputs, nonempty
from pallas_kernels.mixed_mla.config import CHUNK, MosaicMixedMlaConfig
from pallas_kernels.shared import device, fp_formats
from pallas_kernels.shared import mosaic_gpu_compat as compat
from pallas_kernels.shared.common import cdiv, resolve_interpret
from pallas_kernels.shared.kernel import Unsupported
from pallas_kernels.shared.mosaic_gpu import (
  F32_TRANSFORMS,
  NUM_CONSUMERS,
  TILE_COLS,
  WGMMA_TRANSFORMS,
  consumer_registers,
  drain_releases,
  fill_ring_slot,
  finish_rows,
  gather_ring_scratch,
  gather_shared_memory_bytes,
  num_sms,
  rescale_and_accumulate,
  softmax_carry,
  softmax_step,
  store_rows,
)
from pallas_kernels.shared.mosaic_gpu import GATHER_FAULTS as FAULTS
from pallas_kernels.shared.online_softmax import LOG2_E
from pallas_kernels.shared.split_kv import combine_splits
from pallas_kernels.sparse_mla.slots import blocks_per_split, slot_block_limits, split_runs

BLOCK_H = 64  # heads per CTA: one wgmma row tile
HEAD_DIM = 512
# The splits the heuristic makes at most: a sequence's 640 slots are 10
# blocks of 64, so B = 1 can spread over 10 CTAs.
MAX_SPLITS = 10
# The producer dequantizes one 64 x 64 tile at a time through its
# registers; the consumers hold two 64 x 128 fp32 outputs (128 registers),
# the score tile, its chunk's wgmma accumulator and the key scales (80).
# The one split that compiles without spills (docs/perf/mosaic_gpu.md).
PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = consumer_registers(PRODUCER_REGISTERS)

# The staged records: FP8 as 16-bit words (TMA's 256-element box limit:
# 256 value words, then the 8 scale words), FP4 as bytes (256 + 32). The
# 16-byte tiling keeps Mosaic GPU from tiling them for its register loads
# (a 528- or 288-byte row is not a multiple of its default 64 columns).
FP8_WORDS = (HEAD_DIM + 4 * (HEAD_DIM // CHUNK)) // 2
FP4_BYTES = HEAD_DIM // 2 + HEAD_DIM // FP4_GROUP
STAGING8_TRANSFORMS = (plgpu.TilingTransform((1, 8)),)  # pyright: ignore[reportAbstractUsage] (public API; a jax Protocol reads as abstract)
FP4_SCALE_TILE = 16
STAGING4_TRANSFORMS = (plgpu.TilingTransform((1, FP4_SCALE_TILE)),)  # pyright: ignore[reportAbstractUsage] (public API; a jax Protocol reads as abstract)
PAIR = TILE_COLS // 2  # bytes (FP4) or words (FP8) behind one 64-dim chunk


def permute_dims(x: jax.Array) -> jax.Array:
  """The kernel's order of the last axis: each 64-dim chunk as its even
  dims, then its odd dims."""
  *lead, d = x.shape
  return x.reshape(*lead, d // TILE_COLS, PAIR, 2).swapaxes(-1, -2).reshape(*lead, d)


def unpermute_dims(x: jax.Array) -> jax.Array:
  """The inverse of `permute_dims`."""
  *lead, d = x.shape
  return x.reshape(*lead, d // TILE_COLS, 2, PAIR).swapaxes(-1, -2).reshape(*lead, d)


def shared_memory_bytes(config: MosaicMixedMlaConfig, slots: int) -> int:
  """The scratch the kernel allocates: Q (then O), the ring, both staging
  buffers, both consumers' P hi and lo tiles (bf16), the ring's scale
  tables, the sequence's slot table (`slots` int32), sinks, scales and lse
  (4 bytes each), each aligned to 1 KiB, the barriers, and the 2 KiB more
  Mosaic GPU reports at lowering."""
  bk, stages = config.block_k, config.stages
  buffers = [
    BLOCK_H * HEAD_DIM * 2,
    stages * bk * HEAD_DIM * 2,
    bk * FP8_WORDS * 2,
    bk * FP4_BYTES,
    NUM_CONSUMERS * BLOCK_H * bk * 2,
    NUM_CONSUMERS * BLOCK_H * bk * 2,
    stages * (HEAD_DIM // CHUNK) * bk * 4,
  ]
  return gather_shared_memory_bytes(buffers, slots, BLOCK_H, stages)


def _slots(sizes: MixedMlaSizes, block_k: int) -> int:
  """Slots of a sequence's table: each cache's slots padded to whole blocks."""
  return (cdiv(sizes.k8, block_k) + cdiv(sizes.k4, block_k)) * block_k


def fit(config: MosaicMixedMlaConfig, sizes: MixedMlaSizes) -> MosaicMixedMlaConfig:
  """`config` with `splits` cut to the runs its slot blocks make, none empty."""
  return dataclasses.replace(config, splits=split_runs(_slots(sizes, config.block_k), config.block_k, config.splits))


def choose_config(shapes: Mapping[str, Any]) -> MosaicMixedMlaConfig:
  """64 slots a step through one ring slot; a sequence's slot blocks split
  over as many CTAs as keep one wave (at most `MAX_SPLITS`, one block
  each): the recorded B = 1-3 take 10 splits of one block (10-30 CTAs, the
  latency of one step each); B >= `num_sms()` none."""
  sizes = MixedMlaSizes.of(shapes)
  ctas = max(sizes.batch, 1) * max(sizes.heads // BLOCK_H, 1)
  splits = min(MAX_SPLITS, max(1, num_sms() // ctas))
  return fit(MosaicMixedMlaConfig(splits=splits), sizes)


def candidate_configs(shapes: Mapping[str, Any]) -> list[MosaicMixedMlaConfig]:
  """The heuristic's first, then fewer splits (2 blocks, 5 blocks a CTA,
  none), then 2 ring slots where they fit (not at D = 512)."""
  sizes = MixedMlaSizes.of(shapes)
  chosen = choose_config(shapes)
  sweep = [
    chosen,
    *(fit(dataclasses.replace(chosen, splits=s), sizes) for s in (5, 2, 1)),
    dataclasses.replace(chosen, stages=2),
  ]
  return [
    c
    for c in dict.fromkeys(sweep)
    if shared_memory_bytes(c, _slots(sizes, c.block_k)) <= device.SHARED_MEMORY_PER_BLOCK
  ]


def check_supported(q: jax.Array) -> None:
  """Raises `Unsupported` for inputs this kernel does not take: q not
  bf16, H not a multiple of 64, D other than 512."""
  _, heads, head_dim = q.shape
  if q.dtype != jnp.bfloat16:
    raise Unsupported(f"q must be bfloat16 for the Mosaic GPU mixed MLA decode, got {q.dtype}")
  if heads % BLOCK_H:
    raise Unsupported(f"H={heads} must be a multiple of {BLOCK_H} for the Mosaic GPU mixed MLA decode")
  if head_dim != HEAD_DIM:
    raise Unsupported(f"head dim D={head_dim} must be {HEAD_DIM} for the Mosaic GPU mixed MLA decode")


# ---------------------------------------------------------------------------
# The producer's dequantization (registers in the WGMMA layout).


def _column(tile, k: int | jax.Array):
  """Column `k` of an int32 tile of non-negative values, one value a row
  (`Layout.WGMMA.reduce(1)`): the tile masked to it, reduced over columns."""
  cols = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, tile.shape, 1), plgpu.Layout.WGMMA)
  return jnp.max(jnp.where(cols == k, tile, 0), axis=1)


def _load(ref):
  return plgpu.load(ref, layout=plgpu.Layout.WGMMA, optimized=False).astype(jnp.int32)


def _fp8_chunk(staging, j: int):
  """64-dim chunk j of the staged FP8 records, `[block_k, 64]` f32 unscaled
  e4m3 values in the kernel's order: word w of the chunk holds dims 2w
  (low byte) and 2w + 1."""
  words = _load(staging.at[:, pl.ds(PAIR * j, PAIR)])
  return jnp.concatenate([fp_formats.e4m3_to_f32(words & 0xFF), fp_formats.e4m3_to_f32(words >> 8)], axis=1)


def _fp8_scales(staging):
  """The staged records' f32 scales, one `[block_k]` row vector per 128-dim
  chunk (word pairs after the values, little-endian)."""
  words = _load(staging.at[:, pl.ds(HEAD_DIM // 2, FP8_WORDS - HEAD_DIM // 2)])
  return [
    lax.bitcast_convert_type((_column(words, 2 * c + 1) << 16) | _column(words, 2 * c), jnp.float32)
    for c in range(HEAD_DIM // CHUNK)
  ]


def _fp4_chunk(staging, j):
  """64-dim chunk j of the staged FP4 records, `[block_k, 64]` f32 scaled
  values in the kernel's order: byte b of the chunk holds dims 2b (low
  nibble) and 2b + 1, both in scale group (64 j + 2 b) // 16, so each
  8-column slice of either half has one scale a row. The chunk's 4 scale
  bytes come from the one 16-byte staging tile holding them (loading all 32
  scale bytes per chunk makes the producer spill)."""
  packed = _load(staging.at[:, pl.ds(PAIR * j, PAIR)])
  groups = TILE_COLS // FP4_GROUP
  chunks_per_tile = FP4_SCALE_TILE // groups
  scale_bytes = _load(staging.at[:, pl.ds(HEAD_DIM // 2 + FP4_SCALE_TILE * (j // chunks_per_tile), FP4_SCALE_TILE)])
  scales = [
    fp_formats.ue8m0_to_f32(_column(scale_bytes, groups * lax.rem(j, chunks_per_tile) + g)) for g in range(groups)
  ]
  width = PAIR // groups

  def scaled(codes):
    values = fp_formats.e2m1_to_f32(codes)
    return jnp.concatenate(
      [
        values[:, width * g : width * (g + 1)] * lax.broadcast_in_dim(s, (values.shape[0], width), [0])
        for g, s in enumerate(scales)
      ],
      axis=1,
    )

  return jnp.concatenate([scaled(packed & 0xF), scaled(packed >> 4)], axis=1)


# ---------------------------------------------------------------------------
# Kernel.


def _kernel(
  q_gmem,
  kv8_gmem,
  zeros8_gmem,
  kv4_gmem,
  zeros4_gmem,
  idx_gmem,
  limits_gmem,
  sink_gmem,
  scale_gmem,
  o_gmem,
  lse_gmem,
  *,
  config: MosaicMixedMlaConfig,
  blocks8: int,
  blocks_per_split: int,
  interpret: bool,
  fault: str | None,
):
  bk, stages = config.block_k, config.stages
  half = HEAD_DIM // NUM_CONSUMERS
  chunks_per_half = half // TILE_COLS
  scale_chunks = HEAD_DIM // CHUNK
  group, split, seq = lax.axis_index("h"), lax.axis_index("s"), lax.axis_index("b")
  heads = pl.ds(group * BLOCK_H, BLOCK_H)
  run = split * blocks_per_split
  first = jnp.maximum(limits_gmem[seq, 0], run)
  steps = jnp.maximum(jnp.minimum(limits_gmem[seq, 1], run + blocks_per_split) - first, 0)

  def scoped(
    buffers,
    staging8,
    staging4,
    p_hi_smem,
    p_lo_smem,
    ring_scales,
    idx_smem,
    sink_smem,
    scale_smem,
    lse_smem,
    start,
    staged,
    ring_full,
    ring_empty,
    done,
  ):
    wg = lax.axis_index("wg")
    (q_smem, ring), partial_smem = buffers

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
      plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
      for h in range(NUM_CONSUMERS):
        plgpu.copy_gmem_to_smem(q_gmem.at[seq, heads, pl.ds(h * half, half)], q_smem.at[h], start)
      plgpu.copy_gmem_to_smem(sink_gmem.at[heads], sink_smem, start)
      plgpu.copy_gmem_to_smem(scale_gmem.at[heads], scale_smem, start)
      plgpu.copy_gmem_to_smem(idx_gmem.at[seq], idx_smem, start)
      plgpu.barrier_wait(start)

      def gather(src, zeros, dst, pieces, slot_in_block, index):
        """Record `src[index]` (a zero record for an invalid slot) into row
        `slot_in_block` of `dst`, one copy per (start, width) piece."""
        valid = index >= 0
        for begin, width in pieces:
          cols = pl.ds(begin, width)
          row = dst.at[pl.ds(slot_in_block, 1), cols]
          pl.when(valid)(lambda cols=cols, row=row: plgpu.copy_gmem_to_smem(src.at[pl.ds(index, 1), cols], row, staged))
          pl.when(~valid)(lambda cols=cols, row=row: plgpu.copy_gmem_to_smem(zeros.at[pl.ds(0, 1), cols], row, staged))

      def store_chunk(slot, j, values):
        ring.at[slot, j // chunks_per_half][:, pl.ds(lax.rem(j, chunks_per_half) * TILE_COLS, TILE_COLS)] = (
          plgpu.layout_cast(values.astype(ring.dtype), plgpu.Layout.WGMMA)
        )

      # The chunk loops are not unrolled: unrolled, the loads of later
      # chunks are hoisted and the producer's registers spill.
      def dequantize_fp8(slot):
        @pl.loop(0, HEAD_DIM // TILE_COLS)
        def _(j):
          store_chunk(slot, j, _fp8_chunk(staging8, j))

        for c, scale in enumerate(_fp8_scales(staging8)):
          ring_scales[slot, c] = scale

      def dequantize_fp4(slot):
        @pl.loop(0, HEAD_DIM // TILE_COLS)
        def _(j):
          store_chunk(slot, j, _fp4_chunk(staging4, j))

        ones = plgpu.layout_cast(jnp.ones((bk,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        for c in range(scale_chunks):
          ring_scales[slot, c] = ones

      @pl.loop(0, steps)
      def _step(g):
        block = first + g
        is_fp8 = block < blocks8

        @pl.loop(0, bk)
        def _slot(t):
          index = idx_smem[block, t]
          pl.when(is_fp8)(
            lambda: gather(
              kv8_gmem,
              zeros8_gmem,
              staging8,
              ((0, HEAD_DIM // 2), (HEAD_DIM // 2, FP8_WORDS - HEAD_DIM // 2)),
              t,
              index,
            )
          )
          pl.when(~is_fp8)(
            lambda: gather(
              kv4_gmem,
              zeros4_gmem,
              staging4,
              ((0, HEAD_DIM // 2), (HEAD_DIM // 2, FP4_BYTES - HEAD_DIM // 2)),
              t,
              index,
            )
          )

        def dequantize(slot):
          pl.when(is_fp8)(lambda: dequantize_fp8(slot))
          pl.when(~is_fp8)(lambda: dequantize_fp4(slot))

        fill_ring_slot(g, stages, staged, ring_empty, ring_full, dequantize, staged_late=fault == "staged_late")

      drain_releases(steps, stages, ring_empty)

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
      plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
      plgpu.barrier_wait(start)
      row_layout, key_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
      qk_scale = plgpu.load(scale_smem, layout=row_layout)
      own = scale_chunks // NUM_CONSUMERS  # value chunks of 128 dims a consumer owns
      acc, m, l = softmax_carry(BLOCK_H, CHUNK)
      accs = [acc] * own

      def key_scales(slot, c):
        return lax.broadcast_in_dim(plgpu.load(ring_scales.at[slot, c], layout=key_layout), (BLOCK_H, bk), [1])

      def step(g, carry):
        accs, m, l = carry
        slot = lax.rem(g, stages)
        plgpu.barrier_wait(ring_full.at[slot])

        def add_chunk_scores(c, s):
          # Loops, not unrolled: unrolled, the wgmma operand descriptors of
          # every step stay live (the sparse MLA kernel's finding).
          def product(s_ref):
            @pl.loop(0, CHUNK // TILE_COLS)
            def _(k):
              tile = c * (CHUNK // TILE_COLS) + k  # 64-column tile of D
              h, cols = tile // chunks_per_half, pl.ds(lax.rem(tile, chunks_per_half) * TILE_COLS, TILE_COLS)
              plgpu.wgmma(s_ref, q_smem.at[h].at[:, cols], ring.at[slot, h].at[:, cols].T)

            return s_ref[...]

          return s + pl.run_scoped(product, plgpu.ACC((BLOCK_H, bk), jnp.float32)) * key_scales(slot, c)  # pyright: ignore[reportPrivateImportUsage] (public Pallas alias)

        s = lax.fori_loop(
          0,
          scale_chunks,
          add_chunk_scores,
          plgpu.layout_cast(jnp.zeros((BLOCK_H, bk), jnp.float32), plgpu.Layout.WGMMA),
        )
        s = s * lax.broadcast_in_dim(qk_scale, s.shape, [0])
        index = plgpu.load(idx_smem.at[first + g], layout=key_layout)
        valid = lax.broadcast_in_dim(index >= 0, s.shape, [1])
        p, correction, m_next, l_next = softmax_step(s, valid, m, l)
        new_accs = []
        for i, acc in enumerate(accs):
          weights = p * key_scales(slot, wg * own + i)
          hi = weights.astype(p_hi_smem.dtype)
          # The previous chunk's P V wgmmas have completed.
          p_hi_smem[wg] = hi
          p_lo_smem[wg] = (weights - hi.astype(jnp.float32)).astype(p_lo_smem.dtype)
          plgpu.commit_smem()
          # (Hi and lo in two buffers, each indexed by `wg` alone: a constant
          # index into a ref the compiled accumulation closes over does not
          # lower.)
          values = ring.at[slot, wg].at[:, pl.ds(i * CHUNK, CHUNK)]
          new_accs.append(
            rescale_and_accumulate(acc, correction, [(p_hi_smem.at[wg], values), (p_lo_smem.at[wg], values)], interpret)
          )
        plgpu.barrier_arrive(ring_empty.at[slot])
        return new_accs, m_next, l_next

      accs, m, l = lax.fori_loop(0, steps, step, (accs, m, l))
      plgpu.barrier_arrive(done)
      plgpu.barrier_wait(done)
      sink = plgpu.load(sink_smem, layout=row_layout) if config.splits == 1 else None
      outs, lse = finish_rows(accs, m, l, sink)
      out = q_smem.at[wg] if config.splits == 1 else partial_smem.at[wg]
      where = (seq, heads) if config.splits == 1 else (seq, split, heads)
      store_rows(wg, outs, lse, out, lse_smem, o_gmem.at[*where, pl.ds(wg * half, half)], lse_gmem.at[*where])

  dtype = q_gmem.dtype
  pl.run_scoped(
    scoped,
    plgpu.RefUnion(
      (
        plgpu.SMEM((NUM_CONSUMERS, BLOCK_H, half), dtype, transforms=WGMMA_TRANSFORMS),
        plgpu.SMEM((stages, NUM_CONSUMERS, bk, half), dtype, transforms=WGMMA_TRANSFORMS),
      ),
      plgpu.SMEM((NUM_CONSUMERS, BLOCK_H, half), jnp.float32, transforms=F32_TRANSFORMS),
    ),
    plgpu.SMEM((bk, FP8_WORDS), jnp.uint16, transforms=STAGING8_TRANSFORMS),
    plgpu.SMEM((bk, FP4_BYTES), jnp.uint8, transforms=STAGING4_TRANSFORMS),
    plgpu.SMEM((NUM_CONSUMERS, BLOCK_H, bk), dtype, transforms=WGMMA_TRANSFORMS),
    plgpu.SMEM((NUM_CONSUMERS, BLOCK_H, bk), dtype, transforms=WGMMA_TRANSFORMS),
    plgpu.SMEM((stages, scale_chunks, bk), jnp.float32),
    *gather_ring_scratch(idx_gmem.shape[1:], BLOCK_H, bk, stages, fault),
    collective_axes="wg",
  )


def _slot_blocks(indices: jax.Array, rows: int, block_k: int) -> jax.Array:
  """`[B, K]` indices -> `[B, cdiv(K, block_k) * block_k]` with every invalid
  slot (outside `[0, rows)`) and the padding -1."""
  valid = (indices >= 0) & (indices < rows)
  idx = jnp.where(valid, indices, -1).astype(jnp.int32)
  return jnp.pad(idx, ((0, 0), (0, -indices.shape[1] % block_k)), constant_values=-1)


def _forward(
  q,
  kv_fp8,
  indices_fp8,
  kv_fp4,
  indices_fp4,
  sm_scale,
  attn_sink,
  *,
  config: MosaicMixedMlaConfig,
  interpret: bool,
  fault: str | None = None,
):
  """(out, lse) past the checks (B >= 1, caches with a row); `fault`
  (tests only, one of `FAULTS`) breaks the synchronization on purpose."""
  if fault is not None and fault not in FAULTS:
    raise ValueError(f"fault must be None or one of {FAULTS}, got {fault!r}")
  batch, heads, head_dim = q.shape
  bk, splits = config.block_k, config.splits
  rows8, rows4 = kv_fp8.shape[0] * kv_fp8.shape[1], kv_fp4.shape[0] * kv_fp4.shape[1]
  idx8 = _slot_blocks(indices_fp8, rows8, bk)
  idx = jnp.concatenate([idx8, _slot_blocks(indices_fp4, rows4, bk)], axis=1)
  blocks = idx.shape[1] // bk
  limits = slot_block_limits(idx, jnp.iinfo(jnp.int32).max, bk)
  # The FP8 records as 16-bit words (a bitcast): a word is two dims.
  kv8 = lax.bitcast_convert_type(kv_fp8.reshape(rows8, FP8_WORDS, 2), jnp.uint16)
  kv4 = kv_fp4.reshape(rows4, FP4_BYTES)
  qk_scale = jnp.full((heads,), jnp.asarray(sm_scale, jnp.float32) * LOG2_E, jnp.float32)
  if splits == 1:
    out_type = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((batch, heads), jnp.float32))
  else:
    out_type = (
      jax.ShapeDtypeStruct((batch, splits, heads, head_dim), jnp.float32),
      jax.ShapeDtypeStruct((batch, splits, heads), jnp.float32),
    )
  kernel = compat.kernel(
    functools.partial(
      _kernel,
      config=config,
      blocks8=idx8.shape[1] // bk,
      blocks_per_split=blocks_per_split(blocks * bk, bk, splits),
      interpret=interpret,
      fault=fault,
    ),
    out_type=out_type,
    grid=(heads // BLOCK_H, splits, batch),
    grid_names=("h", "s", "b"),
    num_threads=NUM_CONSUMERS + 1,
    thread_name="wg",
    name=__name__,
    interpret=interpret,
  )
  sink = attn_sink.astype(jnp.float32)
  out, lse = kernel(
    permute_dims(q),
    kv8,
    jnp.zeros((1, FP8_WORDS), jnp.uint16),
    kv4,
    jnp.zeros((1, FP4_BYTES), jnp.uint8),
    idx.reshape(batch, blocks, bk),
    limits,
    sink,
    qk_scale,
  )
  if splits > 1:
    out, lse = combine_splits(
      out,
      lse,
      sink,
      stage=config.combine,
      out_dtype=q.dtype,
      with_lse=True,
      name="mixed_mla_decode_combine",
      interpret=interpret,
    )
  return unpermute_dims(out), lse


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
  config: MosaicMixedMlaConfig | None = None,
  interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Mixed FP8/FP4 MLA decode: the contract of
  `pallas_kernels.mixed_mla.triton.mixed_mla_decode` on the inputs this
  kernel takes (`check_supported`), `Unsupported` otherwise.

  Returns `(out [B, H, D] bf16, lse [B, H] f32)`; rows with no valid index
  give 0 and +inf. `config` None = `choose_config`; a config whose buffers
  exceed the SM's shared memory is refused (ValueError)."""
  check_inputs(q, kv_fp8, indices_fp8, kv_fp4, indices_fp4, attn_sink)
  check_supported(q)
  batch, heads, _ = q.shape
  if batch == 0:  # nothing to launch
    return jnp.zeros(q.shape, q.dtype), jnp.zeros((0, heads), jnp.float32)
  kv_fp8, indices_fp8 = nonempty(kv_fp8, indices_fp8)
  kv_fp4, indices_fp4 = nonempty(kv_fp4, indices_fp4)
  sizes = MixedMlaSizes.of({"q": q, "indices_fp8": indices_fp8, "indices_fp4": indices_fp4})
  config = fit(config or choose_config({"q": q, "indices_fp8": indices_fp8, "indices_fp4": indices_fp4}), sizes)
  need = shared_memory_bytes(config, _slots(sizes, config.block_k))
  if need > device.SHARED_MEMORY_PER_BLOCK:
    raise ValueError(
      f"{config} needs {need} bytes of shared memory; the limit is {device.SHARED_MEMORY_PER_BLOCK} (fewer stages)"
    )
  return _forward(
    q,
    kv_fp8,
    indices_fp8,
    kv_fp4,
    indices_fp4,
    sm_scale,
    attn_sink,
    config=config,
    interpret=resolve_interpret(interpret),
  )
