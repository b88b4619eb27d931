"""What the warp-specialized Mosaic GPU kernels share: the register split of
their warpgroups, the shared-memory layouts of wgmma operands and stores, the
8-row alignment TMA asks of copied arrays, and the SM count.

Every kernel runs one producer warpgroup (TMA loads; `setmaxnreg` down to
`PRODUCER_REGISTERS`) and `NUM_CONSUMERS` consumer warpgroups (wgmma;
`setmaxnreg` up to `CONSUMER_REGISTERS`): 40 x 128 + 2 x 232 x 128 = 64512 of
an SM's 65536 registers. A producer that needs more (one that moves data
through its registers) takes them from the consumers: `consumer_registers`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.shared import device
from pallas_kernels.shared.online_softmax import LOG2_E, lse_base2, lse_natural

PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232
NUM_CONSUMERS = 2
# The registers a CTA of three warpgroups starts with: 168 a thread (the
# most ptxas gives 384 threads) x 384. `setmaxnreg` moves registers between
# the warpgroups within it.
CTA_REGISTERS = 168 * 128 * (NUM_CONSUMERS + 1)


def consumer_registers(producer_registers: int) -> int:
  """The most each consumer warpgroup may `setmaxnreg` to (a multiple of 8)
  when the producer keeps `producer_registers`: what the CTA starts with,
  shared by the consumers (`consumer_registers(PRODUCER_REGISTERS) ==
  CONSUMER_REGISTERS`)."""
  return (CTA_REGISTERS // 128 - producer_registers) // NUM_CONSUMERS // 8 * 8


# wgmma operands in shared memory: (8, 64)-element tiles of bf16 with the
# 128-byte swizzle.
SWIZZLE_BYTES = 128
TILE_COLS = SWIZZLE_BYTES // 2
WGMMA_TRANSFORMS = (plgpu.TilingTransform((8, TILE_COLS)), plgpu.SwizzleTransform(SWIZZLE_BYTES))  # pyright: ignore[reportAbstractUsage] (public API; a jax Protocol reads as abstract)
# An fp32 tile stored by TMA: (8, 32)-element tiles, the 128-byte swizzle.
F32_TRANSFORMS = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(SWIZZLE_BYTES))  # pyright: ignore[reportAbstractUsage] (public API; a jax Protocol reads as abstract)
# The same swizzle in 1-row tiles: a TMA store from such a buffer views the
# destination row by row, so it needs no 8-row alignment.
ROW_TRANSFORMS = (plgpu.TilingTransform((1, TILE_COLS)), plgpu.SwizzleTransform(SWIZZLE_BYTES))  # pyright: ignore[reportAbstractUsage] (public API; a jax Protocol reads as abstract)
# Mosaic GPU's TMA views a copied array in the tiles of its shared-memory
# side: an array copied to or from a WGMMA_TRANSFORMS buffer needs a
# multiple of this many rows.
ROW_ALIGN = 8


# Gathering kernels (sparse and mixed MLA): faults a test may ask for. The
# first two take one arrival from a barrier (`gather_ring_scratch`);
# "staged_late" moves the producer's wait on `staged` after its copy of the
# staging buffer into the ring (the kernels' producer loops).
GATHER_FAULTS = ("release_once", "staged_short", "staged_late")


def gather_ring_scratch(slot_table: tuple[int, ...], heads: int, block_k: int, stages: int, fault: str | None) -> tuple:
  """The scratch a gathering kernel allocates after its buffers, in this
  order: the row's slot table (int32 `slot_table`); the `heads` heads'
  sinks, scales and lse (fp32); and the barriers of the protocol its
  docstring argues: `start` (5 arrivals: Q's two halves, sinks, scales,
  slot table), `staged` (two copies a slot of a step), `ring_full[stages]`
  (the producer), `ring_empty[stages]` (each consumer) and `done` (each
  consumer). `fault` (tests only, one of `GATHER_FAULTS`) takes one
  arrival from `staged` or `ring_empty`."""
  return (
    plgpu.SMEM(slot_table, jnp.int32),
    *(plgpu.SMEM((heads,), jnp.float32) for _ in range(3)),
    plgpu.Barrier(num_arrivals=5),
    plgpu.Barrier(num_arrivals=2 * block_k - (fault == "staged_short")),
    plgpu.Barrier(num_arrivals=1, num_barriers=stages),
    plgpu.Barrier(num_arrivals=1 if fault == "release_once" else NUM_CONSUMERS, num_barriers=stages),
    plgpu.Barrier(num_arrivals=NUM_CONSUMERS),
  )


def align_kib(nbytes: int) -> int:
  """`nbytes` rounded up to 1 KiB, the 128-byte swizzle's period: how the
  kernels' scratch buffers are laid out."""
  return -(-nbytes // 1024) * 1024


def gather_shared_memory_bytes(buffers: list[int], slots: int, heads: int, stages: int) -> int:
  """A gathering kernel's shared memory: its `buffers` (bytes each) and
  `gather_ring_scratch` (`slots` int32 entries, three fp32 vectors of
  `heads`), each aligned to 1 KiB, its barriers, and the 2 KiB more Mosaic
  GPU reports at lowering."""
  tail = [slots * 4] + [heads * 4] * 3
  return sum(map(align_kib, buffers + tail)) + 8 * (3 + 2 * stages) + 2048


def pad_rows(x: jax.Array, axis: int) -> jax.Array:
  """`x` with zero rows appended along `axis` up to a multiple of
  `ROW_ALIGN` (x itself when it is one already)."""
  extra = -x.shape[axis] % ROW_ALIGN
  if not extra:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)


def num_sms() -> int:
  """The SM count a persistent grid sizes itself for: the abstract device's
  (deviceless lowering under `jax.sharding.use_abstract_mesh`), else the
  GPU's, else `device.DEFAULT_NUM_SMS`."""
  abstract = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  cores = getattr(abstract, "num_cores", None)
  return int(cores) if isinstance(cores, int) and cores > 0 else device.num_sms()


def fill_ring_slot(
  g, stages: int, staged, ring_empty, ring_full, fill: Callable[[Any], None], *, staged_late: bool = False
) -> None:
  """One step g of a gathering producer, after it issued the step's
  gathers: waits for them (`staged`) and for ring slot g % stages to be
  released by its previous use (step g - stages; the first `stages` uses
  have none), has `fill(slot)` move the staging buffer into the slot, then
  publishes it (`ring_full`). The commit makes the stores visible to the
  consumers' wgmmas and orders this warpgroup's reads of the staging
  buffer before the next gather. `staged_late` (a test-only fault, the
  kernels' `staged_late`) waits for the gathers only after the fill, so the
  staged rows are read before they land: a race the detector reports."""
  if not staged_late:
    plgpu.barrier_wait(staged)
  slot = lax.rem(g, stages)

  @pl.when(g >= stages)
  def _():
    plgpu.barrier_wait(ring_empty.at[slot])

  fill(slot)
  if staged_late:
    plgpu.barrier_wait(staged)
  plgpu.commit_smem()
  plgpu.barrier_arrive(ring_full.at[slot])


def drain_releases(steps, stages: int, *empty) -> None:
  """The producer's last waits: on the release of each of the last
  `stages` steps of a ring of `steps` uses (step g in slot g % stages), for
  every barrier array in `empty`, skipping the first use of each slot (the
  producer never waited on those phases, nothing precedes them). After its
  loop has waited on the releases of steps `< steps - stages`, this lets
  the producer observe every phase of every release barrier (the 0.11.2
  interpreter requires it before the barriers are freed)."""

  @pl.loop(jnp.maximum(steps - stages, stages), steps)
  def _drain(g):
    for barriers in empty:
      plgpu.barrier_wait(barriers.at[lax.rem(g, stages)])


def rendezvous(barrier) -> None:
  """A meeting of the consumers: each arrives on `barrier` (one arrival per
  consumer) and waits for its phase, which completes once all arrived
  (FlashAttention-3's ping-pong turns)."""
  plgpu.barrier_arrive(barrier)
  plgpu.barrier_wait(barrier)


def softmax_carry(rows: int, width: int):
  """The online softmax's start in the wgmma layouts: row maxima -inf and
  row sums 0 (`Layout.WGMMA.reduce(1)`), and a `[rows, width]` fp32 output
  accumulator of zeros (`Layout.WGMMA`)."""
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  return (
    plgpu.layout_cast(jnp.zeros((rows, width), jnp.float32), plgpu.Layout.WGMMA),
    plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), row_layout),
    plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), row_layout),
  )


def softmax_step(s, visible, m, l, step_max=None):
  """One step of `online_softmax.online_softmax_step` on a wgmma score tile
  (`s [rows, keys]` fp32, base 2, already scaled): hidden scores (`visible`
  False) become -inf, a row that has seen nothing subtracts 0. Returns
  `(p, correction, m_next, l_next)`: the probabilities, the factor the
  output accumulator is rescaled by before `p V` is added, and the next
  row maxima and sums. `step_max`: the step's row maxima when `s` is only
  part of the step's scores (default: `s`'s own, hidden ones excluded);
  `l_next` then sums `s`'s part only."""
  s = jnp.where(visible, s, -jnp.inf)
  m_next = jnp.maximum(m, s.max(axis=1) if step_max is None else step_max)
  m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
  correction = jnp.exp2(m - m_safe)
  p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
  return p, correction, m_next, correction * l + p.sum(axis=1)


def rescale_and_accumulate(acc, correction, products, interpret: bool):
  """`acc * correction[:, None] + sum(P @ V for P, V in products)` (fp32
  `acc`; each P and V a bf16 shared-memory ref, wgmma operands).

  Compiled, the wgmmas accumulate onto the rescaled output in the output's
  own registers (`pl.run_state` over a preinitialized accumulator): no
  second accumulator is live beside it (a 64 x 256 fp32 output is 128
  registers a thread). The CPU interpreter cannot run a preinitialized
  accumulator ("Cannot lower jaxpr with effects"), so in interpret mode the
  products go to a fresh accumulator that is added by value: the same sum,
  another fp32 addition order. Returns once the wgmmas completed (their
  result was read), so the caller may overwrite the P tiles."""
  rescaled = acc * lax.broadcast_in_dim(correction, acc.shape, [0])
  if interpret:

    def product(pv_ref):
      for p_ref, v_ref in products:
        plgpu.wgmma(pv_ref, p_ref, v_ref)
      return pv_ref[...]

    return rescaled + pl.run_scoped(product, plgpu.ACC(acc.shape, jnp.float32))  # pyright: ignore[reportPrivateImportUsage] (public Pallas alias)

  def accumulate(acc_ref):
    for p_ref, v_ref in products:
      plgpu.wgmma(acc_ref, p_ref, v_ref)

  return pl.run_state(accumulate)(plgpu.ACC.init(rescaled))  # pyright: ignore[reportPrivateImportUsage] (public Pallas alias)


def finish_rows(accs, m, l, sink=None):
  """The online softmax's end on wgmma tiles: `(outputs, lse)` of the
  output accumulators `accs` (a list of `[rows, width]` fp32 tiles) and the
  row maxima `m` / sums `l` (base 2).

  With `sink` (natural-log sink logits per row; an unsplit kernel's final
  result): `acc / (l + exp(sink) 2**-m)` and the natural-log lse without
  the sink (`online_softmax.normalize`, `lse_natural`). Without (one split's
  partial, for `split_kv.combine_splits`, which adds the sink): `acc / l`
  and the base-2 lse. A row that saw nothing gives 0, and lse +inf
  (final) or -inf (partial)."""
  seen = l > 0.0
  denominator = l
  if sink is not None:
    denominator = l + jnp.exp2(sink * LOG2_E - jnp.where(seen, m, 0.0))
  inverse = jnp.where(seen, 1.0 / denominator, 0.0)
  outputs = [acc * lax.broadcast_in_dim(inverse, acc.shape, [0]) for acc in accs]
  return outputs, (lse_natural(m, l) if sink is not None else lse_base2(m, l))


def store_rows(wg, outs, lse, out_smem, lse_smem, o_gmem, lse_gmem):
  """A consumer warpgroup's epilogue: `outs` (its `[rows, width]` tiles, in
  column order) into `out_smem`, the rows' `lse` into `lse_smem`, then both to
  global memory by TMA: `out_smem` to `o_gmem` (already indexed down to this
  warpgroup's rows and column half), `lse_smem` to `lse_gmem`. Both consumers
  hold the same rows' lse; warpgroup 0 alone writes and stores it (two
  writers of one buffer would race, the race detector's finding)."""
  width = out_smem.shape[-1] // len(outs)
  for i, value in enumerate(outs):
    out_smem[:, pl.ds(i * width, width)] = value.astype(out_smem.dtype)

  @pl.when(wg == 0)
  def _():
    lse_smem[...] = lse

  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(out_smem, o_gmem)
  pl.when(wg == 0)(lambda: plgpu.copy_smem_to_gmem(lse_smem, lse_gmem))
  plgpu.wait_smem_to_gmem(0)
