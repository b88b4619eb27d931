"""3-D neighborhood attention forward on Mosaic GPU (Hopper-native),
FlashAttention-3 style, K and V halos by multi-dimensional TMA.

Contract: `triton.neighborhood_attention_3d`'s (NATTEN semantics, stride 1,
dilation 1, non-causal, q already scaled) for q, k, v `[B, T, Y, X, H, D]`
bf16 with D = 64; other inputs raise `Unsupported` (so `backend="pallas"`
falls back to Triton). The gradient is the Triton backward
(`triton_bwd.attention_backward`) from this kernel's o and its lse
`[B, H, T, Y, X]` (base 2, the Triton forward's semantics).

Structure: grid (CTA tiles, H, B), tiles in C order (x fastest, so that the
CTAs running together share their key boxes in L2); three warpgroups per
CTA. The geometry is static (`boxes.py`, its docstring): a CTA owns two
consumer query tiles of `block_t x block_y x block_x` = 64 points stacked
along y and a key box covering both tiles' windows; the box is walked plane
by plane (t), and each consumer scores only its run of a plane's rows (the
lines its own windows reach).

- warpgroup 2, the producer (`setmaxnreg` 40), copies each plane of K and
  of V as one 3-D TMA box `[extent_y, extent_x, D]` straight from the
  `[B, T, Y, X, H, D]` layout into a ring of `stages` slots. The box's
  origin is clamped into the grid (windows shift inward, so it still holds
  them); where the grid is shorter than the box, TMA fills the keys past
  its end with zeros and no window reaches them.
- warpgroups 0 and 1, the consumers (`setmaxnreg` 232), each own a query
  tile: Q (one 4-D TMA box, copied through registers into a wgmma operand
  tile), the queries' window probes and the plane's row bits once; then
  per plane, in chunks of their run: S = Q K^T (wgmma), the window test
  (`(row bits & probe) == probe`; the t test is per row: a row that does
  not see the plane probes for a bit no key has), the online softmax in
  registers (base 2, the `log2 e` scale in one fma a score), and
  O = O c + P V (wgmma, P from registers when compiled). The epilogue
  divides by the row sums and stores O and lse by TMA (4-D and 3-D boxes,
  clipped at the grid's edges). With `config.ping_pong` the two consumers
  alternate FlashAttention-3's way: one's softmax runs while the other's
  S or P V wgmma does.

Two views of each ring: TMA writes `[plane, lines, extent_x, D]` in 1-row
tiles (Mosaic GPU's TMA asks a box's offset along a tiled dimension to be a
multiple of the tile, and the box's x origin is any column), wgmma reads
`[plane, rows, D]` in (8, 64) tiles (`plgpu.RefUnion`, one allocation).
Both are rows of 128 bytes in C order with the 128-byte swizzle keyed to
the address, so row r of a plane is the same bytes in both; a run starts
at a multiple of 8 rows (`extent_x` is a multiple of 8), a whole tile.
Interpret mode (Mosaic GPU's CPU interpreter) runs the same TMA copies,
barriers, ring and rendezvous, but its wgmma reads neither an aliased nor a
reshaped ref, nor a register operand: there each consumer loads its run of
K and V from the ring (plain shared-memory reads, after the same waits and
before the same releases) and forms the two products as jnp dots of those
values (bf16 operands, fp32 accumulation: what the interpreter's wgmma
computes). The compiled wgmma operands (the rows view, its dynamic run
offset, P from registers) are checked by the H100 lowering and the sm_90a
compile, not by the interpreter.

Synchronization (interpret mode does not check asynchrony):

- Ring position: plane p is in slot p % stages; producer and both
  consumers walk every plane in the same order.
- `k_full[s]` and `v_full[s]` (1 arrival: the plane's TMA box) guard slot
  s's K and V; both consumers wait on them for every plane (a consumer
  waits on `v_full` before its first P V wgmma of the plane).
- `k_empty[s]` and `v_empty[s]` (2 arrivals, one per consumer) guard reuse.
  A consumer releases K of a plane after the last S wgmma of its run has
  completed (reading the accumulator waits for it), V after the last P V
  wgmma (same; `rescale_and_accumulate` returns once its wgmmas completed).
  Compiled, only wgmma (the async proxy, as TMA) reads the ring; in
  interpret mode the run is read through the generic proxy and
  `commit_smem()` (a proxy fence) follows the read, so the producer's next
  TMA into the slot, which the release allows, is ordered after it (the
  race detector checks this: the `uncommitted` fault drops the fence). The
  producer waits on `k_empty[s]` before refilling K of plane p >= stages
  and on `v_empty[s]` before V, and at the end waits for the last
  release of every slot it waited on, so it observes every completion
  (`drain_releases`).
- Parity: use u of slot s completes phase u of each of the four barriers;
  every waiter waits on every phase in order.
- Ping-pong (`config.ping_pong`): `turn` (2 arrivals) is a rendezvous; per
  chunk a consumer meets the other twice, after issuing its S wgmma and
  after its softmax (before its P V wgmma); consumer 1 meets once more
  before its first chunk and consumer 0 once more after its last, so
  consumer 1 is one rendezvous behind. Both consumers walk the same planes
  in the same chunks (a run's chunking is static), so each makes
  `2 * planes * chunks + 1` meets and waits, in the same order. No cycle of
  waits: both consumers are on the same plane or one apart at any meet,
  and the producer waits only on the releases of planes `stages` >= 2
  behind the one it fills, which both consumers made before they reached
  the plane either of them waits on.
- `q_barrier[w]` (3 arrivals: Q, the probes, the row bits) guards consumer
  w's inputs (one wait). Consumer w's Q operand tile is written by it only,
  before its first wgmma, with `commit_smem()`; its staging tile takes O
  only after its last wgmma. Epilogue: each consumer writes its own O and
  lse staging, `commit_smem()`, TMA stores, and waits for them before
  exiting.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.neighborhood_attention import boxes
from pallas_kernels.neighborhood_attention.config import MosaicNeighborhoodConfig, NeighborhoodAttentionBwdConfig
from pallas_kernels.neighborhood_attention.triton import (
  NeighborhoodAttentionSizes,
  check_inputs,
  choose_backward_config,
)
from pallas_kernels.neighborhood_attention.triton_bwd import Static, with_backward
from pallas_kernels.shared import device
from pallas_kernels.shared import mosaic_gpu_compat as compat
from pallas_kernels.shared.common import cdiv, resolve_interpret
from pallas_kernels.shared.kernel import Unsupported
from pallas_kernels.shared.mosaic_gpu import (
  CONSUMER_REGISTERS,
  NUM_CONSUMERS,
  PRODUCER_REGISTERS,
  WGMMA_TRANSFORMS,
  align_kib,
  drain_releases,
  rendezvous,
  rescale_and_accumulate,
)
from pallas_kernels.shared.online_softmax import LOG2_E

HEAD_DIM = 64
QUERIES = 64  # a consumer tile: one wgmma row block
# K and V planes as TMA writes them: `[lines, extent_x, D]` boxes in 1-row
# tiles, 128-byte swizzle.
BOX_TRANSFORMS = (
  plgpu.TilingTransform((1, 1, HEAD_DIM)),  # pyright: ignore[reportAbstractUsage]
  plgpu.SwizzleTransform(128),  # pyright: ignore[reportAbstractUsage]
)
# Q in and O out: `[block_t, block_y, block_x, D]` boxes in 1-row tiles
# (any block_x), 128-byte swizzle.
STAGE_TRANSFORMS = (
  plgpu.TilingTransform((1, 1, 1, HEAD_DIM)),  # pyright: ignore[reportAbstractUsage]
  plgpu.SwizzleTransform(128),  # pyright: ignore[reportAbstractUsage]
)
# lse rows are stored with a multiple of 4 along x (TMA strides are
# multiples of 16 bytes) and sliced back.
LSE_ALIGN = 4

# A probe no key's window bits satisfy (bit 31: keys use bits 0-30): the
# probe of a row that does not see a plane.
UNSEEN = jnp.iinfo(jnp.int32).min

# The online softmax's first row maximum: finite also times LOG2_E.
START_MAX = float(jnp.finfo(jnp.float32).min) / 2

# Test-only sync faults (`_forward(fault=...)`).
FAULTS = ("release_once", "turn_once", "uncommitted")


def box_plan(dims, window, config: MosaicNeighborhoodConfig) -> boxes.BoxPlan:
  """The static geometry of a problem under `config` (ValueError when the
  tiling does not fit it)."""
  return boxes.plan(tuple(dims), tuple(window), config.tile, config.max_chunk_keys)


def shared_memory_bytes(plan: boxes.BoxPlan, config: MosaicNeighborhoodConfig) -> int:
  """The scratch Mosaic GPU allocates (compiled): per consumer a Q operand
  tile, a Q/O staging tile, lse staging, probes and the row bit table; the
  K and V rings (a plane a slot); each aligned to 1 KiB; and the 2 KiB more
  (barriers included) Mosaic GPU reports at lowering (equal to its report
  for the heuristic configs of every recorded definition)."""
  buffers = [
    NUM_CONSUMERS * QUERIES * HEAD_DIM * 2,
    NUM_CONSUMERS * QUERIES * HEAD_DIM * 2,
    NUM_CONSUMERS * QUERIES * 4,
    NUM_CONSUMERS * QUERIES * 4,
    NUM_CONSUMERS * plan.plane_rows * 4,
    2 * config.stages * plan.plane_rows * HEAD_DIM * 2,
  ]
  return sum(map(align_kib, buffers)) + 2048


# ---------------------------------------------------------------------------
# Heuristic and candidates.


def _tiles() -> list[tuple[int, int, int]]:
  """Consumer tiles of 64 points with at least 4 along x (the lse store's
  16-byte rows), powers of two."""
  sides = [1, 2, 4, 8, 16]
  return [
    (t, y, QUERIES // (t * y)) for t in sides for y in sides if QUERIES % (t * y) == 0 and QUERIES // (t * y) >= 4
  ]


def _fitting(dims, window, configs) -> list[MosaicNeighborhoodConfig]:
  out = []
  for c in configs:
    try:
      plan = box_plan(dims, window, c)
    except ValueError:
      continue
    if shared_memory_bytes(plan, c) <= device.SHARED_MEMORY_PER_BLOCK:
      out.append(c)
  return out


def choose_config(shapes: Mapping[str, Any], *, KT: int, KY: int, KX: int) -> MosaicNeighborhoodConfig:
  """The consumer tile that scores the fewest (query, key) pairs over the
  grid (`BoxPlan.scored_pairs`), chunks of up to 256 keys (a run a chunk), 3 ring stages
  (2 where 3 do not fit)."""
  dims, window = NeighborhoodAttentionSizes.of(shapes).grid, (KT, KY, KX)
  configs = [MosaicNeighborhoodConfig(*tile, stages=s) for s in (3, 2) for tile in _tiles()]
  fits = _fitting(dims, window, configs)
  if not fits:
    return MosaicNeighborhoodConfig()
  # Fewest scored pairs; among equals, more stages, then the flattest tile in t.
  return min(fits, key=lambda c: (box_plan(dims, window, c).scored_pairs(), -c.stages, c.block_t, -c.block_x))


def candidate_configs(shapes: Mapping[str, Any], *, KT: int, KY: int, KX: int) -> list[MosaicNeighborhoodConfig]:
  """The heuristic's first; its tile with the other stage count, with
  128-key chunks and without ping-pong; then the next two tiles by scored
  pairs (those that fit), one config per distinct kernel."""
  dims, window = NeighborhoodAttentionSizes.of(shapes).grid, (KT, KY, KX)
  chosen = choose_config(shapes, KT=KT, KY=KY, KX=KX)
  variants = [
    dataclasses.replace(chosen, stages=5 - chosen.stages) if chosen.stages in (2, 3) else chosen,
    dataclasses.replace(chosen, max_chunk_keys=128),
    dataclasses.replace(chosen, ping_pong=False),
  ]
  others = sorted(
    _fitting(dims, window, [MosaicNeighborhoodConfig(*tile, stages=2) for tile in _tiles() if tile != chosen.tile]),
    key=lambda c: box_plan(dims, window, c).scored_pairs(),
  )[:2]
  # One config per distinct kernel (a chunk bound at or above the run's
  # length changes nothing).
  kernels = {}
  for c in [chosen, *_fitting(dims, window, variants), *others]:
    kernels.setdefault((box_plan(dims, window, c), c.stages, c.ping_pong), c)
  return list(kernels.values())


# ---------------------------------------------------------------------------
# Kernel.


def _softmax_carry():
  """The online softmax's start in the wgmma layouts: an fp32 `[64, D]`
  output of zeros, row maxima at `START_MAX` (finite, so that a chunk
  hiding all of a row's keys needs no guard: `exp2(-inf - m) = 0`, its
  correction `exp2(0) = 1`), row sums 0."""
  rows = plgpu.Layout.WGMMA.reduce(1)
  return (
    plgpu.layout_cast(jnp.zeros((QUERIES, HEAD_DIM), jnp.float32), plgpu.Layout.WGMMA),
    plgpu.layout_cast(jnp.full((QUERIES,), START_MAX, jnp.float32), rows),
    plgpu.layout_cast(jnp.zeros((QUERIES,), jnp.float32), rows),
  )


def _softmax_step(s, visible, m, l):
  """One step of the online softmax (`online_softmax.online_softmax_step`
  with `score_scale`, `finite_max`) on a wgmma score tile of raw scores
  (q is pre-scaled): hidden scores become -inf, the row maxima `m` stay in
  score units and the `LOG2_E` scale folds into one fma a score
  (`exp2(s log2 e - m log2 e)`; a positive scale commutes with max).
  Returns `(p, correction, m_next, l_next)`."""
  s = jnp.where(visible, s, -jnp.inf)
  m_next = jnp.maximum(m, s.max(axis=1))
  m_scaled = m_next * LOG2_E
  correction = jnp.exp2(m * LOG2_E - m_scaled)
  p = jnp.exp2(s * LOG2_E - lax.broadcast_in_dim(m_scaled, s.shape, [0]))
  return p, correction, m_next, correction * l + p.sum(axis=1)


def _kernel(
  q_gmem,
  k_gmem,
  v_gmem,
  probes_gmem,
  bits_gmem,
  o_gmem,
  lse_gmem,
  *,
  plan: boxes.BoxPlan,
  config: MosaicNeighborhoodConfig,
  interpret: bool,
  fault: str | None,
):
  (t_len, y_len, x_len), (kt, ky, kx) = plan.dims, plan.window
  (bt, by, bx), (et, ey, ex) = plan.tile, plan.extents
  stages = config.stages
  tile, head, batch = lax.axis_index("tile"), lax.axis_index("h"), lax.axis_index("b")
  _, tiles_y, tiles_x = plan.tiles
  tile_t, tile_y, tile_x = tile // (tiles_y * tiles_x), (tile // tiles_x) % tiles_y, tile % tiles_x
  t0, y0, x0 = tile_t * bt, tile_y * (NUM_CONSUMERS * by), tile_x * bx

  def origin(first, length, k, extent):
    """`boxes.box_origin` of a traced first query."""
    return jnp.minimum(jnp.clip(first - k // 2, 0, length - k), max(length - extent, 0))

  box_t, box_y, box_x = origin(t0, t_len, kt, et), origin(y0, y_len, ky, ey), origin(x0, x_len, kx, ex)

  def scoped(q_op, stage, lse_stage, probe_smem, bits_smem, rings, q_barrier, k_full, v_full, k_empty, v_empty, turn):
    wg = lax.axis_index("wg")
    # The rings as TMA writes them (`[plane, lines, extent_x, D]` in 1-row
    # tiles: a box may start at any x) and as wgmma reads them (`[plane,
    # rows, D]` in (8, 64) tiles): the same bytes (module docstring).
    (k_boxes, v_boxes), (k_rows, v_rows) = rings

    def meet():
      """A rendezvous of the two consumers (ping-pong only)."""
      if config.ping_pong:
        rendezvous(turn)

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
      plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

      @pl.loop(0, et)
      def _plane(p):
        slot = lax.rem(p, stages)
        plane = (batch, box_t + p, pl.ds(box_y, ey), pl.ds(box_x, ex), head)
        for gmem, ring, full, empty in ((k_gmem, k_boxes, k_full, k_empty), (v_gmem, v_boxes, v_full, v_empty)):
          pl.when(p >= stages)(functools.partial(plgpu.barrier_wait, empty.at[slot]))
          plgpu.copy_gmem_to_smem(gmem.at[plane], ring.at[slot], full.at[slot])

      drain_releases(et, stages, k_empty, v_empty)

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
      plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
      queries = (batch, pl.ds(t0, bt), pl.ds(y0 + wg * by, by), pl.ds(x0, bx), head)
      plgpu.copy_gmem_to_smem(q_gmem.at[queries], stage.at[wg], q_barrier.at[wg])
      plgpu.copy_gmem_to_smem(probes_gmem.at[tile, wg], probe_smem.at[wg], q_barrier.at[wg])
      plgpu.copy_gmem_to_smem(bits_gmem, bits_smem.at[wg], q_barrier.at[wg])
      plgpu.barrier_wait(q_barrier.at[wg])
      # The Q tile into the wgmma operand's layout (through registers).
      if interpret:
        q_tile = stage[wg].reshape(QUERIES, HEAD_DIM)
      else:
        q_op[wg] = plgpu.load(stage.at[wg].reshape(QUERIES, HEAD_DIM), layout=plgpu.Layout.WGMMA)
        plgpu.commit_smem()
      probe = plgpu.load(probe_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
      t_field = (1 << plan.widths[0]) - 1
      probe_yx = probe & ~t_field
      # This consumer's run of plane rows (a multiple of 8: whole tiles).
      run = pl.multiple_of(plan.run_start(jnp.minimum(y0 + wg * by, y_len - 1), box_y), boxes.ROW_TILE)
      if interpret:
        row_bits = lax.dynamic_slice_in_dim(bits_smem[wg].reshape(plan.plane_rows), run, plan.run)

      def operand(ring_boxes, ring_rows, slot):
        """The run's `[keys, D]` K or V of slot `slot`: the rows view of the
        slot (compiled, a wgmma operand), or its value (interpret mode, read
        through the generic proxy: `commit_smem()` orders the read before
        the producer's next TMA into the slot, which the release allows)."""
        if not interpret:
          return ring_rows.at[slot, pl.ds(run, plan.run)]
        rows = lax.dynamic_slice_in_dim(ring_boxes[slot].reshape(plan.plane_rows, HEAD_DIM), run, plan.run)
        if fault != "uncommitted":
          plgpu.commit_smem()
        return rows

      def scores(k_run, offset, keys):
        """S = Q K^T of one chunk (fp32), the first rendezvous under it."""
        if interpret:
          meet()
          return jnp.dot(q_tile, k_run[offset : offset + keys].T, preferred_element_type=jnp.float32)

        def wgmma(s_ref):
          plgpu.wgmma(s_ref, q_op.at[wg], k_run.at[pl.ds(offset, keys)].T)
          meet()  # the other consumer's softmax runs under this wgmma
          return s_ref[...]

        return pl.run_scoped(wgmma, plgpu.ACC((QUERIES, keys), jnp.float32))  # pyright: ignore[reportPrivateImportUsage]

      def accumulate(acc, correction, p, v_run, offset, keys):
        """O c + P V of one chunk (returns once the wgmma completed)."""
        if interpret:
          pv = jnp.dot(p, v_run[offset : offset + keys], preferred_element_type=jnp.float32)
          return acc * lax.broadcast_in_dim(correction, acc.shape, [0]) + pv
        return rescale_and_accumulate(acc, correction, [(p, v_run.at[pl.ds(offset, keys)])], interpret=False)

      def plane(p, carry):
        slot = lax.rem(p, stages)
        # The t test is per row (a row sees the whole plane or none of it):
        # rows that do not see it probe for a bit no key has.
        sees_plane = (probe & boxes.plane_bits(p, kt, plan.widths[0])) != 0
        want = jnp.where(sees_plane, probe_yx, UNSEEN)
        plgpu.barrier_wait(k_full.at[slot])
        k_run = operand(k_boxes, k_rows, slot)
        v_run = None
        for i, (offset, keys) in enumerate(plan.chunks):
          acc, m, l = carry
          s = scores(k_run, offset, keys)
          if i == len(plan.chunks) - 1:
            plgpu.barrier_arrive(k_empty.at[slot])  # every S wgmma of the plane has completed
          if interpret:
            bits = row_bits[offset : offset + keys]
          else:
            bits = plgpu.load(
              bits_smem.at[wg].reshape(plan.plane_rows).at[pl.ds(run + offset, keys)],
              layout=plgpu.Layout.WGMMA.reduce(0),
            )
          bits = lax.broadcast_in_dim(bits, s.shape, [1])
          want_tile = lax.broadcast_in_dim(want, s.shape, [0])
          p_, correction, m_next, l_next = _softmax_step(s, (bits & want_tile) == want_tile, m, l)
          if config.ping_pong:  # done with the softmax; the tensor cores are free once the other arrives
            plgpu.barrier_arrive(turn)
          if i == 0:
            plgpu.barrier_wait(v_full.at[slot])
          if config.ping_pong:
            plgpu.barrier_wait(turn)
          if v_run is None:
            v_run = operand(v_boxes, v_rows, slot)
          acc = accumulate(acc, correction, p_.astype(q_gmem.dtype), v_run, offset, keys)
          carry = acc, m_next, l_next
        plgpu.barrier_arrive(v_empty.at[slot])  # every P V wgmma of the plane has completed
        return carry

      pl.when(wg == 1)(meet)  # consumer 1 starts one rendezvous behind
      acc, m, l = lax.fori_loop(0, et, plane, _softmax_carry())
      pl.when(wg == 0)(meet)  # ... and consumer 0 makes up for it at the end
      seen = l > 0.0
      inverse = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
      out = (acc * lax.broadcast_in_dim(inverse, acc.shape, [0])).astype(stage.dtype)
      lse = jnp.where(seen, m * LOG2_E + jnp.log2(jnp.where(seen, l, 1.0)), jnp.inf)
      # O reuses the Q staging tile (its copy into q_op was read long ago).
      if interpret:
        stage[wg] = out.reshape(bt, by, bx, HEAD_DIM)
        lse_stage[wg] = lse.reshape(bt, by, bx)
      else:
        stage.at[wg].reshape(QUERIES, HEAD_DIM)[...] = out
        lse_stage.at[wg].reshape(QUERIES)[...] = lse
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(stage.at[wg], o_gmem.at[queries])
      plgpu.copy_smem_to_gmem(
        lse_stage.at[wg], lse_gmem.at[batch, head, pl.ds(t0, bt), pl.ds(y0 + wg * by, by), pl.ds(x0, bx)]
      )
      plgpu.wait_smem_to_gmem(0)

  dtype = q_gmem.dtype
  ring = (stages, ey, ex, HEAD_DIM)
  rows = (stages, plan.plane_rows, HEAD_DIM)
  pl.run_scoped(
    scoped,
    plgpu.SMEM((NUM_CONSUMERS, QUERIES, HEAD_DIM), dtype, transforms=WGMMA_TRANSFORMS),
    plgpu.SMEM((NUM_CONSUMERS, bt, by, bx, HEAD_DIM), dtype, transforms=STAGE_TRANSFORMS),
    plgpu.SMEM((NUM_CONSUMERS, bt, by, bx), jnp.float32),
    plgpu.SMEM((NUM_CONSUMERS, QUERIES), jnp.int32),
    plgpu.SMEM((NUM_CONSUMERS, ey, ex), jnp.int32),
    plgpu.RefUnion(
      tuple(plgpu.SMEM(ring, dtype, transforms=BOX_TRANSFORMS) for _ in range(2)),
      tuple(plgpu.SMEM(rows, dtype, transforms=WGMMA_TRANSFORMS) for _ in range(2)),
    ),
    plgpu.Barrier(num_arrivals=3, num_barriers=NUM_CONSUMERS),
    plgpu.Barrier(num_arrivals=1, num_barriers=stages),
    plgpu.Barrier(num_arrivals=1, num_barriers=stages),
    plgpu.Barrier(num_arrivals=1 if fault == "release_once" else NUM_CONSUMERS, num_barriers=stages),
    plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages),
    plgpu.Barrier(num_arrivals=1 if fault == "turn_once" else NUM_CONSUMERS),
    collective_axes="wg",
  )


def _forward(q, k, v, *, window, config: MosaicNeighborhoodConfig, interpret: bool, fault: str | None = None):
  """(o, lse `[B, H, T, Y, X]`) of one launch; `fault` (tests only, one of
  `FAULTS`) breaks the synchronization on purpose."""
  if fault is not None and fault not in FAULTS:
    raise ValueError(f"fault must be None or one of {FAULTS}, got {fault!r}")
  batch, *dims, heads, _ = q.shape
  plan = box_plan(dims, window, config)
  if shared_memory_bytes(plan, config) > device.SHARED_MEMORY_PER_BLOCK:
    raise ValueError(
      f"{config} needs {shared_memory_bytes(plan, config)} bytes of shared memory for window {window}; the limit "
      f"is {device.SHARED_MEMORY_PER_BLOCK} (fewer stages or a smaller tile)"
    )
  x_lse = cdiv(dims[2], LSE_ALIGN) * LSE_ALIGN
  kernel = compat.kernel(
    functools.partial(_kernel, plan=plan, config=config, interpret=interpret, fault=fault),
    out_type=(
      jax.ShapeDtypeStruct(q.shape, q.dtype),
      jax.ShapeDtypeStruct((batch, heads, *dims[:2], x_lse), jnp.float32),
    ),
    grid=(math.prod(plan.tiles), heads, batch),
    grid_names=("tile", "h", "b"),
    num_threads=NUM_CONSUMERS + 1,
    thread_name="wg",
    name=__name__,
    interpret=interpret,
  )
  row_bits = jnp.asarray(plan.row_bits().reshape(plan.extents[1:]))
  o, lse = kernel(q, k, v, boxes.probes(plan), row_bits)
  return o, lse[..., : dims[2]]


def check_supported(q: jax.Array) -> None:
  """Raises `Unsupported` for inputs this kernel does not take: q (and k, v)
  not bf16, or a head dim other than 64."""
  if q.dtype != jnp.bfloat16:
    raise Unsupported(f"q, k, v must be bfloat16 for the Mosaic GPU neighborhood attention, got {q.dtype}")
  if q.shape[-1] != HEAD_DIM:
    raise Unsupported(f"head dim D={q.shape[-1]} must be {HEAD_DIM} for the Mosaic GPU neighborhood attention")


def _differentiated_forward(q, k, v, static: Static, with_lse: bool):
  """`o`, or `(o, lse)`: `triton_bwd.with_backward`'s forward (the kernel
  always writes lse)."""
  o, lse = _forward(q, k, v, window=static.window, config=static.config, interpret=static.interpret)
  return (o, lse) if with_lse else o


_attention = with_backward(_differentiated_forward)


@functools.partial(jax.jit, static_argnames=("KT", "KY", "KX", "config", "backward_config", "interpret"))
def neighborhood_attention_3d(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  KT: int,
  KY: int,
  KX: int,
  config: MosaicNeighborhoodConfig | None = None,
  backward_config: NeighborhoodAttentionBwdConfig | None = None,
  interpret: bool | None = None,
) -> jax.Array:
  """3-D neighborhood attention, NATTEN semantics, no extra scale: the
  contract of `triton.neighborhood_attention_3d` on the inputs this kernel
  takes (`check_supported`: bf16, D = 64), `Unsupported` otherwise.

  `config`: tiling (None = `choose_config`); `backward_config`: the Triton
  backward's tilings (None = its heuristic). Differentiable (`jax.custom_vjp`)
  in q, k and v through the Triton dQ and dK/dV kernels."""
  window = check_inputs(q, k, v, KT, KY, KX)
  check_supported(q)
  if not (q.shape[0] and q.shape[-2]):
    return jnp.zeros(q.shape, q.dtype)
  shapes = {"q": jax.ShapeDtypeStruct(q.shape, q.dtype)}
  static = Static(
    window,
    config or choose_config(shapes, KT=KT, KY=KY, KX=KX),
    backward_config or choose_backward_config(shapes, KT=KT, KY=KY, KX=KX),
    resolve_interpret(interpret),
  )
  return _attention(q, k, v, static)
