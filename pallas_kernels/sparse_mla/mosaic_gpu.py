"""DeepSeek sparse MLA prefill on Mosaic GPU (Hopper): a producer warpgroup
gathers the selected latent rows, two consumer warpgroups run the 64-head
tile on wgmma.

Contract: the Triton kernel's (`pallas_kernels.sparse_mla.triton`): q
`[M, H, D]` bf16, kv `[Nkv, 1, D]`, indices `[M, 1, TOPK]` (valid:
`0 <= idx < Nkv`; anything else is an invalid slot that contributes nothing
and whose row is never read), a scalar `sm_scale` (may be traced),
`attn_sink [H]` f32 in the denominator only. Returns `(out [M, H, D] bf16,
lse [M, H] f32 natural log, no sink)`; a lonely row (no valid slot) gives 0
and +inf. This kernel takes H a multiple of 64 and D 256 or 512
(`check_supported`; `Unsupported` otherwise, so `backend="pallas"` falls
back to Triton).

Structure: grid (H / 64, splits, M); a CTA owns one query row and 64 heads
and walks the row's slot blocks of `block_k` (from the first to one past the
last block holding a valid index: `slots.slot_block_limits`), or with
`config.splits > 1` its split's run of them: it then writes fp32 partials
(normalized output, base-2 lse) that the shared `split_kv.combine_splits`
merges with the sink (a second launch, a Triton kernel). The heuristic
splits only grids that leave half the SMs idle (no recorded M does).
Three warpgroups:

- warpgroup 2, the producer (`setmaxnreg` 56: `PRODUCER_REGISTERS`): Q
  (two halves of D), the sinks, the scales and the row's indices once by
  TMA; per step, one TMA per slot and half of D (`D / 2 <= 256` columns: a
  TMA box) gathers row `kv[idx]` into an untiled staging buffer (an invalid
  slot copies a row of zeros instead, so every step makes the same number
  of copies and no invalid index is ever dereferenced); then it copies the
  staged rows through its registers (WGMMA layout, 64-column chunks) into
  the ring slot, in the wgmma operand layout. Mosaic GPU's TMA cannot write
  one row into an (8, 64)-tiled buffer, hence the staging (docs/perf/
  mosaic_gpu.md, "Sparse MLA prefill: gathering rows on Hopper"). The next
  step's gather runs while the consumers compute on the ring; the copy into
  the ring waits for their release (one ring slot fits beside the staging
  buffer at D = 512).
- warpgroups 0 and 1, the consumers (`setmaxnreg` 224). With
  `config.half_slots` (the default) consumer w scores its half of the
  step's slots, `S_w = Q K_w^T` over slots `[w bk/2, (w+1) bk/2)` (a loop
  of wgmmas over 64-column chunks of D), writes its row maxima to shared
  memory and, after a rendezvous, takes the step's maxima from both
  consumers' (the same two values in the same order in both, so m, the P
  scale and the output correction are bitwise the same in both); its
  half of P goes into its 32 columns of the shared P tile, and after a
  second rendezvous `O = O * correction + P V` over the whole tile (all
  the step's slots) for its own half of the value columns (consumer w:
  columns `[w D/2, (w+1) D/2)`). Each keeps the row sum of its own slots;
  the two are added once, after the last step. The score wgmmas are done
  once a step, not by both consumers (8.4 instead of 12.6 MFLOP of wgmma
  a step). A wgmma's operands share one swizzle and a 32-slot half of P is
  32 columns wide, so Q, the ring and P use the 64-byte swizzle ((8,
  32)-element tiles) there. With `half_slots=False` each consumer computes
  the full scores (so m and l are the same in both without an exchange)
  into its own P tile, in the 128-byte swizzle. Either way the P V wgmma
  accumulates onto the rescaled output in its registers
  (`shared.mosaic_gpu.rescale_and_accumulate`; 64 x 256 fp32 is 128
  registers a thread), and P goes through shared memory (the CPU
  interpreter's wgmma reads both operands from there).
- epilogue: once both consumers are past their last step (a rendezvous: the
  other one's last S wgmma reads all of Q), each writes its half of
  `acc / (l + exp(sink) 2**-m)` into its half of the Q buffer and stores it
  by TMA; consumer 0 stores lse. A split's fp32 partial goes through a
  buffer that aliases Q, the ring and the staging buffer (`RefUnion`): all
  three are dead by then (the producer's last writes preceded its last
  `ring_full` arrival, which both consumers waited on).

Synchronization (interpret mode does not check asynchrony):

- `start` (5 arrivals: two Q halves, sinks, scales, indices): every
  warpgroup waits on it once before it reads any of them.
- `staged` (`2 * block_k` arrivals: one per gather copy, the zeros copies of
  invalid slots included) guards the staging buffer; only the producer waits
  on it, once per step, so its phases are waited in order. The producer
  reads the staging buffer (generic proxy) and then issues the next step's
  TMAs into it (async proxy): `commit_smem()` between them (a proxy fence
  and a warpgroup barrier) orders every thread's reads before the copies.
- `ring_full[s]` (1 arrival: the producer, after `commit_smem()` made its
  stores to slot s visible to the async proxy) guards slot s's data; both
  consumers wait on it before their wgmmas read the slot.
- `ring_empty[s]` (2 arrivals, one per consumer) guards reuse: a consumer
  arrives after its last P V wgmma of the step completed (reading its
  result waits for it), and its S wgmmas completed before (their result was
  read). The producer waits on it before re-laying step g >= stages into
  slot s and, at the end, on the last release of every slot it waited on.
- Ring position and parity: step g is in slot g % stages; producer and
  consumers walk the same steps (from the same `limits` entry), so use u of
  slot s completes phase u of `ring_full[s]` and `ring_empty[s]`, and every
  waiter waits on every phase in order (the producer on all of
  `ring_empty[s]` but its first, which nothing precedes).
- The indices (consumers load each step's block of them for the mask) and
  sinks are written once, before `start` completes, and never again.
- `done` (2 arrivals) is the consumers' rendezvous before the epilogue
  overwrites Q; with `half_slots=False` P tile w is written by consumer w
  only, after its previous P V wgmmas completed, and made visible by
  `commit_smem()`. Consumer 0 alone writes the lse tile (`store_rows`).
- Half-slot consumers: two more rendezvous of the consumers (each arrives,
  then waits; every one of the 128 threads of a warpgroup arrives with
  release semantics after its own stores, and waits with acquire), one
  phase each a step: `maxima_written` after a consumer stored its row
  maxima of the step to its row of `rows_smem`, and `p_written` after it
  stored its half of the P tile and `commit_smem()` (the proxy fence that
  makes the stores visible to the other consumer's wgmma). A consumer
  reads both rows of `rows_smem` only after `maxima_written`'s phase, and
  issues the P V wgmma over the whole tile only after `p_written`'s.
  Reuse: consumer w overwrites its row of `rows_smem` at step g + 1 only
  after passing `p_written` of step g, which needs the other's arrival
  there, made after it read that row at step g; it overwrites its half of
  P at step g + 1 only after passing `maxima_written` of step g + 1, which
  needs the other's arrival there, made after the other's P V wgmmas of
  step g completed (it read their result); its own had too. After the
  last step each stores its row sums to its row of `rows_smem` (after its
  last `p_written`, so the other has read the maxima there) and arrives
  on `done`; each reads both rows after `done`'s phase. Both consumers
  walk the same steps, so each makes one arrival and one wait a step on
  either barrier, in the same order, waiting every phase (the parity rule
  above); they wait on no producer barrier between the two rendezvous
  of a step, and the producer waits only on releases of earlier steps,
  so no cycle of waits exists.

What the CPU interpreter checks of this (docs/perf/mosaic_gpu.md, "Race
detector"; `tests/test_sparse_mla_mosaic.py` breaks the rules it sees):
its race detector, on in every test run, `start` for what the consumers
load, `staged` before the producer reads the staging buffer (`staged_late`:
only it sees that), the `commit_smem()` before the next gather, the
epilogue and the partial buffer's aliasing; its barrier checks, the
arrival counts (`release_once`, `staged_short`, and `exchange_once` for
the half-slot rendezvous, whose `rows_smem` reads the detector orders).
The ring and the P tile are read by wgmma only, which the detector does
not order, and wgmma asynchrony is not modelled: `ring_full`/`ring_empty`
and the P V wgmma after `p_written` rest on this argument.
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

from pallas_kernels.shared import device
from pallas_kernels.shared import mosaic_gpu_compat as compat
from pallas_kernels.shared.common import cdiv, resolve_interpret
from pallas_kernels.shared.kernel import Unsupported
from pallas_kernels.shared.mosaic_gpu import (
  F32_TRANSFORMS,
  GATHER_FAULTS,
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
from pallas_kernels.shared.online_softmax import LOG2_E
from pallas_kernels.shared.split_kv import combine_splits
from pallas_kernels.sparse_mla.config import MosaicSparseMlaConfig
from pallas_kernels.sparse_mla.slots import (
  SparseMlaSizes,
  blocks_per_split,
  check_inputs,
  slot_block_limits,
  split_runs,
)

BLOCK_H = 64  # heads per CTA: one wgmma row tile
# The TOPK splits the heuristic makes at most: each costs a 128 KiB fp32
# partial per row and head group (written, then read by the combine), two
# steps' worth of gathered rows.
MAX_SPLITS = 4
HEAD_DIMS = (256, 512)
# The producer copies the staged rows through its registers (a 64 x 64 bf16
# chunk is 16 a thread): at the usual 40 it spills 28 bytes, at 56 none;
# the consumers then get 224 (their 64 x 256 fp32 output half is 128).
PRODUCER_REGISTERS = 56
CONSUMER_REGISTERS = consumer_registers(PRODUCER_REGISTERS)
# Half-slot consumers: their operands in (8, 32)-element tiles with the
# 64-byte swizzle (a wgmma's operands share one swizzle, and a 32-slot half
# of the probability tile is one such tile wide).
HALF_SWIZZLE_BYTES = 64
HALF_TRANSFORMS = (plgpu.TilingTransform((8, HALF_SWIZZLE_BYTES // 2)), plgpu.SwizzleTransform(HALF_SWIZZLE_BYTES))  # pyright: ignore[reportAbstractUsage] (public API; a jax Protocol reads as abstract)
# Faults a test may ask for (`_forward`): the gathering kernels' two, and the
# half-slot consumers' row-maxima rendezvous counting one arrival.
FAULTS = (*GATHER_FAULTS, "exchange_once")


def shared_memory_bytes(config: MosaicSparseMlaConfig, head_dim: int, topk: int) -> int:
  """The scratch the kernel allocates: Q (then O), the ring, the staging
  buffer, the P tiles (bf16: one per consumer, or with `half_slots` one
  shared tile and both consumers' row maxima, fp32), the row's indices,
  sinks, scales and lse (4 bytes each), each aligned to 1 KiB (the 128-byte swizzle's period),
  the barriers, and the 2 KiB more Mosaic GPU reports at lowering."""
  bk, stages = config.block_k, config.stages
  buffers = [BLOCK_H * head_dim * 2, stages * bk * head_dim * 2, bk * head_dim * 2]
  if config.half_slots:  # one shared P tile, the row maxima of both consumers, two barriers
    buffers += [BLOCK_H * bk * 2, NUM_CONSUMERS * BLOCK_H * 4]
    return gather_shared_memory_bytes(buffers, cdiv(max(topk, 1), bk) * bk, BLOCK_H, stages) + 16
  buffers.append(NUM_CONSUMERS * BLOCK_H * bk * 2)
  return gather_shared_memory_bytes(buffers, cdiv(max(topk, 1), bk) * bk, BLOCK_H, stages)


def fit(config: MosaicSparseMlaConfig, topk: int) -> MosaicSparseMlaConfig:
  """`config` with `splits` cut to the runs its slot blocks make, none
  empty (`slots.split_runs`)."""
  return dataclasses.replace(config, splits=split_runs(topk, config.block_k, config.splits))


def choose_config(shapes: Mapping[str, Any]) -> MosaicSparseMlaConfig:
  """64 slots a step through one ring slot (209 KiB at D = 512, TOPK =
  640; two do not fit), each consumer scoring half of them (`half_slots`):
  the gather of step g + 1 overlaps step g's compute, its copy into the
  ring does not. A CTA fills an SM, so TOPK is split only
  where the unsplit grid leaves at least half the SMs idle, into as many
  splits as still fit one wave (at most `MAX_SPLITS`): M x H / 64 CTAs of
  128 and more (every recorded M) are not split, M = 16 takes 4."""
  sizes = SparseMlaSizes.of(shapes)
  ctas = sizes.m * max(sizes.heads // BLOCK_H, 1)
  splits = min(MAX_SPLITS, max(1, num_sms() // max(ctas, 1)))
  return fit(MosaicSparseMlaConfig(splits=splits), sizes.topk)


def candidate_configs(shapes: Mapping[str, Any]) -> list[MosaicSparseMlaConfig]:
  """The heuristic's first, its tiling unsplit, its consumers each scoring
  all of a step's slots (`half_slots=False`), then 2 and 3 ring slots (the
  copy into the ring overlaps the compute too), those that fit the SM (at
  D = 512 only one ring slot)."""
  sizes = SparseMlaSizes.of(shapes)
  chosen = choose_config(shapes)
  sweep = [
    chosen,
    dataclasses.replace(chosen, splits=1),
    dataclasses.replace(chosen, half_slots=not chosen.half_slots),
    *(dataclasses.replace(chosen, stages=s) for s in (2, 3)),
  ]
  return [
    c
    for c in dict.fromkeys(sweep)
    if shared_memory_bytes(c, sizes.head_dim, sizes.topk) <= device.SHARED_MEMORY_PER_BLOCK
  ]


def check_supported(q: jax.Array) -> None:
  """Raises `Unsupported` for inputs this kernel does not take: q (and kv)
  not bf16, H not a multiple of 64, D other than `HEAD_DIMS`."""
  _, heads, head_dim = q.shape
  if q.dtype != jnp.bfloat16:
    raise Unsupported(f"q and kv must be bfloat16 for the Mosaic GPU sparse MLA prefill, got {q.dtype}")
  if heads % BLOCK_H:
    raise Unsupported(f"H={heads} must be a multiple of {BLOCK_H} for the Mosaic GPU sparse MLA prefill")
  if head_dim not in HEAD_DIMS:
    raise Unsupported(f"head dim D={head_dim} must be one of {HEAD_DIMS} for the Mosaic GPU sparse MLA prefill")


def _kernel(
  q_gmem,
  kv_gmem,
  zeros_gmem,
  idx_gmem,
  limits_gmem,
  sink_gmem,
  scale_gmem,
  o_gmem,
  lse_gmem,
  *,
  config: MosaicSparseMlaConfig,
  blocks_per_split: int,
  num_kv: int,
  interpret: bool,
  fault: str | None,
):
  bk, stages = config.block_k, config.stages
  half = q_gmem.shape[-1] // NUM_CONSUMERS
  chunks = half // TILE_COLS
  group, split, row = lax.axis_index("h"), lax.axis_index("s"), lax.axis_index("m")
  heads = pl.ds(group * BLOCK_H, BLOCK_H)
  # This CTA's run of slot blocks (all of them unsplit), cut to the row's
  # blocks holding a valid index: producer and consumers walk the same ones.
  run = split * blocks_per_split
  first = jnp.maximum(limits_gmem[row, 0], run)
  steps = jnp.maximum(jnp.minimum(limits_gmem[row, 1], run + blocks_per_split) - first, 0)

  def scoped(
    buffers,
    p_smem,
    idx_smem,
    sink_smem,
    scale_smem,
    lse_smem,
    start,
    staged,
    ring_full,
    ring_empty,
    done,
    # Half-slot consumers only: a row of row maxima (after the last step, of
    # row sums) per consumer, and the rendezvous after writing them and
    # after writing P.
    rows_smem: Any = None,
    maxima_written: Any = None,
    p_written: Any = None,
  ):
    wg = lax.axis_index("wg")
    # The partial output of a split reuses Q, the ring and the staging
    # buffer: it is written after the last step of both consumers.
    (q_smem, ring, staging), partial_smem = buffers

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
      plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
      for h in range(NUM_CONSUMERS):
        plgpu.copy_gmem_to_smem(q_gmem.at[row, heads, pl.ds(h * half, half)], q_smem.at[h], start)
      plgpu.copy_gmem_to_smem(sink_gmem.at[heads], sink_smem, start)
      plgpu.copy_gmem_to_smem(scale_gmem.at[heads], scale_smem, start)
      plgpu.copy_gmem_to_smem(idx_gmem.at[row], idx_smem, start)
      plgpu.barrier_wait(start)

      def gather(slot_in_block, index):
        """Row `kv[index]` (zeros for an invalid index) into staging row
        `slot_in_block`, one copy per half of D."""
        valid = (index >= 0) & (index < num_kv)
        for h in range(NUM_CONSUMERS):
          cols = pl.ds(h * half, half)
          dst = staging.at[pl.ds(slot_in_block, 1), cols]
          pl.when(valid)(
            lambda cols=cols, dst=dst: plgpu.copy_gmem_to_smem(kv_gmem.at[pl.ds(index, 1), cols], dst, staged)
          )
          pl.when(~valid)(
            lambda cols=cols, dst=dst: plgpu.copy_gmem_to_smem(zeros_gmem.at[pl.ds(0, 1), cols], dst, staged)
          )

      def to_ring(slot):
        """The staged rows into ring slot `slot`, each consumer's half of D
        in its wgmma layout."""
        for h in range(NUM_CONSUMERS):
          for c in range(chunks):
            rows = plgpu.load(
              staging.at[:, pl.ds(h * half + c * TILE_COLS, TILE_COLS)], layout=plgpu.Layout.WGMMA, optimized=False
            )
            ring.at[slot, h][:, pl.ds(c * TILE_COLS, TILE_COLS)] = plgpu.layout_cast(rows, plgpu.Layout.WGMMA)

      @pl.loop(0, steps)
      def _step(g):
        block = first + g

        @pl.loop(0, bk)
        def _slot(t):
          gather(t, idx_smem[block, t])

        fill_ring_slot(g, stages, staged, ring_empty, ring_full, to_ring, staged_late=fault == "staged_late")

      drain_releases(steps, stages, ring_empty)

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
      plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
      plgpu.barrier_wait(start)
      row_layout = plgpu.Layout.WGMMA.reduce(1)
      qk_scale = plgpu.load(scale_smem, layout=row_layout)
      # This consumer's slots of a step: all of them, or its half.
      width = bk // NUM_CONSUMERS if config.half_slots else bk
      own = pl.ds(wg * width, width) if config.half_slots else pl.ds(0, bk)

      def scores(slot, s_ref):
        # A loop over the 64-column chunks of D, not unrolled: with the 32
        # wgmma steps unrolled, jax 0.11.2's Mosaic GPU code spills 440
        # bytes in the consumers (its operand descriptors stay live).
        @pl.loop(0, NUM_CONSUMERS * chunks)
        def _(c):
          h, cols = c // chunks, pl.ds(lax.rem(c, chunks) * TILE_COLS, TILE_COLS)
          plgpu.wgmma(s_ref, q_smem.at[h].at[:, cols], ring.at[slot, h].at[own, cols].T)

        return s_ref[...]

      def rendezvous(barrier):
        plgpu.barrier_arrive(barrier)
        plgpu.barrier_wait(barrier)

      def swap_rows(values, barrier):
        """Both consumers' `values` (one per row of the tile), consumer 0's
        first: this one's go to its row of `rows_smem`, then the two meet at
        `barrier`. Both consumers combine the same two in the same order, so
        they get the same bits."""
        rows_smem[wg] = values
        rendezvous(barrier)
        return plgpu.load(rows_smem.at[0], layout=row_layout), plgpu.load(rows_smem.at[1], layout=row_layout)

      # This consumer's P tile (with half slots, the one both write a half of
      # and read whole).
      p_tile = p_smem if config.half_slots else p_smem.at[wg]

      def step(g, carry):
        acc, m, l = carry
        slot = lax.rem(g, stages)
        plgpu.barrier_wait(ring_full.at[slot])
        s = pl.run_scoped(functools.partial(scores, slot), plgpu.ACC((BLOCK_H, width), jnp.float32))  # pyright: ignore[reportPrivateImportUsage] (public Pallas alias)
        s = s * lax.broadcast_in_dim(qk_scale, s.shape, [0])
        index = plgpu.load(idx_smem.at[first + g, own], layout=plgpu.Layout.WGMMA.reduce(0))
        valid = lax.broadcast_in_dim((index >= 0) & (index < num_kv), s.shape, [1])
        # With half slots l is the sum over this consumer's slots only.
        step_max = None
        if config.half_slots:  # the step's maxima: m, the P scale and the correction are the same in both
          step_max = jnp.maximum(*swap_rows(jnp.where(valid, s, -jnp.inf).max(axis=1), maxima_written))
        p, correction, m_next, l_next = softmax_step(s, valid, m, l, step_max)
        # The previous step's P V wgmmas have completed (with half slots also
        # the other consumer's: it arrived on `maxima_written` after them).
        p_tile[:, own] = p.astype(p_smem.dtype)
        plgpu.commit_smem()
        if config.half_slots:
          rendezvous(p_written)
        acc = rescale_and_accumulate(acc, correction, [(p_tile, ring.at[slot, wg])], interpret)
        plgpu.barrier_arrive(ring_empty.at[slot])
        return acc, m_next, l_next

      acc, m, l = lax.fori_loop(0, steps, step, softmax_carry(BLOCK_H, half))
      if config.half_slots:  # the row sums of both consumers' slots
        l_first, l_second = swap_rows(l, done)
        l = l_first + l_second
      else:
        rendezvous(done)
      sink = plgpu.load(sink_smem, layout=row_layout) if config.splits == 1 else None
      outs, lse = finish_rows([acc], m, l, sink)
      out = q_smem.at[wg] if config.splits == 1 else partial_smem.at[wg]
      where = (row, heads) if config.splits == 1 else (row, split, heads)
      store_rows(wg, outs, lse, out, lse_smem, o_gmem.at[*where, pl.ds(wg * half, half)], lse_gmem.at[*where])

  dtype = q_gmem.dtype
  head_dim = q_gmem.shape[-1]
  transforms = HALF_TRANSFORMS if config.half_slots else WGMMA_TRANSFORMS
  halves = ()
  if config.half_slots:
    halves = (
      plgpu.SMEM((NUM_CONSUMERS, BLOCK_H), jnp.float32),
      plgpu.Barrier(num_arrivals=1 if fault == "exchange_once" else NUM_CONSUMERS),
      plgpu.Barrier(num_arrivals=NUM_CONSUMERS),
    )
  pl.run_scoped(
    scoped,
    plgpu.RefUnion(
      (
        plgpu.SMEM((NUM_CONSUMERS, BLOCK_H, half), dtype, transforms=transforms),
        plgpu.SMEM((stages, NUM_CONSUMERS, bk, half), dtype, transforms=transforms),
        plgpu.SMEM((bk, head_dim), dtype),
      ),
      plgpu.SMEM((NUM_CONSUMERS, BLOCK_H, half), jnp.float32, transforms=F32_TRANSFORMS),
    ),
    plgpu.SMEM((BLOCK_H, bk) if config.half_slots else (NUM_CONSUMERS, BLOCK_H, bk), dtype, transforms=transforms),
    *gather_ring_scratch(idx_gmem.shape[1:], BLOCK_H, bk, stages, fault),
    *halves,
    collective_axes="wg",
  )


def _forward(
  q, kv, indices, sm_scale, attn_sink, *, config: MosaicSparseMlaConfig, interpret: bool, fault: str | None = None
):
  """(out, lse) of one launch past the checks (at least one row, slot and
  workspace row); `fault` (tests only, one of `FAULTS`) breaks the
  synchronization on purpose."""
  if fault is not None and fault not in FAULTS:
    raise ValueError(f"fault must be None or one of {FAULTS}, got {fault!r}")
  if fault == "exchange_once" and not config.half_slots:
    raise ValueError("fault 'exchange_once' breaks the half-slot consumers' exchange: it needs half_slots=True")
  m, heads, head_dim = q.shape
  num_kv, topk, bk = kv.shape[0], indices.shape[-1], config.block_k
  blocks = cdiv(topk, bk)
  idx = indices.reshape(m, topk).astype(jnp.int32)
  idx = jnp.pad(idx, ((0, 0), (0, blocks * bk - topk)), constant_values=-1)
  limits = slot_block_limits(idx, num_kv, bk)
  qk_scale = jnp.full((heads,), jnp.asarray(sm_scale, jnp.float32) * LOG2_E, jnp.float32)
  splits = config.splits
  if splits == 1:
    out_type = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((m, heads), jnp.float32))
  else:
    out_type = (
      jax.ShapeDtypeStruct((m, splits, heads, head_dim), jnp.float32),
      jax.ShapeDtypeStruct((m, splits, heads), jnp.float32),
    )
  kernel = compat.kernel(
    functools.partial(
      _kernel,
      config=config,
      blocks_per_split=blocks_per_split(topk, bk, splits),
      num_kv=num_kv,
      interpret=interpret,
      fault=fault,
    ),
    out_type=out_type,
    grid=(heads // BLOCK_H, splits, m),
    grid_names=("h", "s", "m"),
    num_threads=NUM_CONSUMERS + 1,
    thread_name="wg",
    name=__name__,
    interpret=interpret,
  )
  zeros = jnp.zeros((1, head_dim), q.dtype)  # what an invalid slot gathers
  sink = attn_sink.astype(jnp.float32)
  out, lse = kernel(q, kv.reshape(num_kv, head_dim), zeros, idx.reshape(m, blocks, bk), limits, sink, qk_scale)
  if splits == 1:
    return out, lse
  return combine_splits(
    out,
    lse,
    sink,
    stage=config.combine,
    out_dtype=q.dtype,
    with_lse=True,
    name="sparse_mla_prefill_combine",
    interpret=interpret,
  )


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def sparse_mla_prefill(
  q: jax.Array,
  kv: jax.Array,
  indices: jax.Array,
  sm_scale: jax.Array | float,
  attn_sink: jax.Array,
  *,
  config: MosaicSparseMlaConfig | None = None,
  interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Sparse MLA prefill attention with an attention sink: the contract of
  `pallas_kernels.sparse_mla.triton.sparse_mla_prefill` on the inputs this
  kernel takes (`check_supported`), `Unsupported` otherwise.

  Returns `(out [M, H, D] bf16, lse [M, H] f32)`; lonely rows give 0 and
  +inf. `config` None = `choose_config`; a config whose buffers exceed the
  SM's shared memory is refused (ValueError)."""
  check_inputs(q, kv, indices, attn_sink)
  check_supported(q)
  m, heads, head_dim = q.shape
  topk, num_kv = indices.shape[-1], kv.shape[0]
  if m == 0 or topk == 0 or num_kv == 0:  # nothing to launch: every row is lonely
    return jnp.zeros(q.shape, q.dtype), jnp.full((m, heads), jnp.inf, jnp.float32)
  config = fit(config or choose_config({"q": q, "indices": indices}), topk)
  need = shared_memory_bytes(config, head_dim, topk)
  if need > device.SHARED_MEMORY_PER_BLOCK:
    raise ValueError(
      f"{config} needs {need} bytes of shared memory at D={head_dim}, TOPK={topk}; the limit is "
      f"{device.SHARED_MEMORY_PER_BLOCK} (fewer stages or a smaller block_k)"
    )
  return _forward(q, kv, indices, sm_scale, attn_sink, config=config, interpret=resolve_interpret(interpret))
