"""Flash attention forward on Mosaic GPU (Hopper-native), FA3-style.

Contract: the forward of `pallas_kernels.flash_attention` (the four
attention definitions): q `[B, Nq, H, D]`, k and v `[B, Nk, H, D]` bf16 with
D 64 or 128; optional `key_valid [B, Nk]` (False hides key j of batch row b:
whatever it holds reaches no output), prefix keys `k_prefix`, `v_prefix`
`[B, Np, H, D]` (the keys are `concat(k_prefix, k)`, every prefix key
visible to every query) and block-causal `segment_ids [B, Nq]` (Nk == Nq;
key j visible to query i iff `segment_ids[j] <= segment_ids[i]`); and the
features of `jaxkern.ops.attention`: grouped K/V heads (read by `h //
group`), causal and sliding-window bands and packed sequences (each query
row's key interval, tested against the step's key positions; only the
band's key blocks are walked), the logit soft cap.
`softmax(q k^T * sm_scale) v` with the online softmax of
`pallas_kernels.shared.online_softmax` in base 2 (scores scaled by
`sm_scale * LOG2_E`, hidden keys selected away to -inf, a row that has seen
nothing subtracts 0 so its probabilities are 0), the probabilities rounded
to bf16 for the value product, the output rounded once; a row that sees no
key outputs 0 and has lse +inf. Also returns `lse [B, H, Nq]` (base 2, the
forward's scale), what a backward recomputes the probabilities from.

Visibility is one comparison: the wrapper gives every key an id (the
prefix's `INT32_MIN`, a key its segment id or 0, a hidden or out-of-range
key `INT32_MAX`) and every query its segment id or 0; key j is visible to
query i iff `key_id[j] <= query_id[i]`. Key blocks past the last one some
row of a query block sees are not visited: the per-(batch row, query block)
step count comes from the Triton kernel's table
(`flash_attention_keys.key_block_limits`), tight for a valid prefix of keys
and nondecreasing segment ids; key blocks before it are all visited, with
the mask (the Triton kernel also skips the mask on blocks every row sees).

Structure: grid (H, query blocks of 2 * block_q, B); three warpgroups per CTA.

- warpgroup 2, the producer (`setmaxnreg` 40), streams K, V and the key ids
  of each `block_k` step (the prefix's steps, then the keys') into a ring of
  `stages` slots with TMA;
- warpgroups 0 and 1, the consumers (`setmaxnreg` 232), each own `block_q`
  query rows: Q and its query ids once by TMA, then per step S = Q K^T
  (wgmma), the masked
  online-softmax update in registers, and O += P V (wgmma; P goes through a
  per-consumer shared-memory tile because the CPU interpreter's wgmma reads
  both operands from shared memory); the epilogue divides by the row sums
  and stores O and lse through shared memory with TMA. With
  `config.ping_pong` the two consumers alternate (FlashAttention-3's
  schedule): while one runs its softmax the other's S or P V wgmma runs.

Ragged sizes: keys past Nk (and past Np in the prefix's last block) are
hidden by their ids (a few bytes per key, built by the wrapper). Mosaic GPU's
TMA views q, k, v, the prefix and O in 8-row tiles, so a length that is not
a multiple of 8 pads that array by < 8 rows (and O and lse are sliced back
to Nq); a multiple of 8 needs no copy. Rows past a sequence within a tile are
zero-filled on load and clipped on store.

Synchronization (interpret mode does not check asynchrony):

- `k_full[s]` (2 arrivals: the K copy and the key-id copy) and `v_full[s]`
  (1: the V copy) guard slot s's data; both consumers wait on them before
  reading K/ids or V of the slot. Each step issues exactly one K copy (from
  the prefix or from k) and one V copy, so the arrival counts hold.
- `k_empty[s]` and `v_empty[s]` (2 arrivals, one per consumer) guard reuse.
  A consumer releases K and the ids of step g after its S wgmma has
  completed (reading the accumulator waits for it) and the ids are in
  registers, read through the generic proxy: `commit_smem()` orders that
  read before the producer's next TMA (async proxy) into the slot; it
  releases V after its P V wgmma completed (same). The
  producer waits on `k_empty[s]` before refilling K/ids of step g >= stages
  and on `v_empty[s]` before V, and at the end waits for the last release of
  every slot it waited on, so it observes every completion.
- Ring position: step g (the prefix's steps first) is in slot g % stages;
  under a band the walk starts at the query block's first step f and step g
  is its use g - f, in slot (g - f) % stages; producer and consumers loop
  over the same steps, read from the same table entries of their query
  block, so they agree on every slot and phase.
- Parity: use u of slot s completes phase u of each of the four barriers;
  every waiter waits on every phase in order (the consumers on all of
  `k_full`/`v_full`, the producer on all of `k_empty`/`v_empty` but each
  slot's first, which nothing precedes).
- Ping-pong (`config.ping_pong`): `turn` (2 arrivals, one per consumer)
  is a rendezvous of the consumers: each arrives and then waits, so a phase
  completes once both reached it. Per step a consumer meets the other twice,
  after issuing its S wgmma and after its softmax (before its P V wgmma);
  consumer 1 meets once more before its first step and consumer 0 once more
  after its last, which puts consumer 1 one rendezvous behind: its S wgmma
  is issued while consumer 0 runs its softmax, and the other way round.
  Both consumers of a CTA walk the same step count, so each makes
  2 * steps + 1 arrivals and waits, in the same order, and every wait sees
  every phase (the parity rule above); the rendezvous never waits on the
  producer, which waits only on the consumers' releases of earlier steps,
  so no cycle of waits exists.
- `q_barrier[w]` (2 arrivals: Q and the query ids; 4 under a band, with
  the rows' lo and hi) guards consumer w's Q
  tile (one wait); the epilogue overwrites it with O after the last S wgmma
  that read it has completed. P tile w is written by consumer w only, after
  its previous P V wgmma completed, and `commit_smem()` makes the writes
  visible to the wgmma. Epilogue: each consumer writes its own O and lse
  slots, `commit_smem()`, TMA stores, and waits for them before exiting.

What the CPU interpreter checks of this (docs/perf/mosaic_gpu.md, "Race
detector"; `tests/test_flash_attention_mosaic.py` breaks the rules it
sees): its race detector, on in every test run, every rule on the key and
query ids (loaded through registers; `ids_released_early` only it sees)
and the epilogue's; its barrier checks, the parity of `k_empty`/`v_empty`
(`release_once`) and of `turn` (`turn_once`). The reads of Q, K, V and P
are wgmma's, which the detector does not order, and wgmma asynchrony is
not modelled: those rest on this argument.
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
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.flash_attention.config import FlashAttentionBwdConfig, MosaicAttentionConfig
from pallas_kernels.flash_attention.keys import (
  INVISIBLE_SEGMENT,
  Logits,
  Window,
  band_intervals,
  band_window,
  checked_operands,
  key_block_limits,
  kv_head_map,
  packed_outputs,
)
from pallas_kernels.flash_attention.triton_bwd import attention_backward, backward_config_for
from pallas_kernels.shared import device
from pallas_kernels.shared import mosaic_gpu_compat as compat
from pallas_kernels.shared.common import resolve_interpret
from pallas_kernels.shared.kernel import Unsupported
from pallas_kernels.shared.mosaic_gpu import (
  CONSUMER_REGISTERS,
  NUM_CONSUMERS,
  PRODUCER_REGISTERS,
  ROW_ALIGN,
  WGMMA_TRANSFORMS,
  drain_releases,
  pad_rows,
  rendezvous,
  softmax_carry,
  softmax_step,
)

HEAD_DIMS = (64, 128)

# Test-only sync faults (`_forward(fault=...)`).
FAULTS = ("release_once", "turn_once", "ids_released_early")


def shared_memory_bytes(config: MosaicAttentionConfig, head_dim: int, *, band: bool = False) -> int:
  """The scratch Mosaic GPU allocates: Q (then O) and P tiles, lse rows and
  query ids of both consumers, K, V and the key ids per slot (bf16
  operands, 4-byte lse and ids), with a `band` the rows' key intervals,
  each buffer aligned to 1 KiB (the 128-byte swizzle's period), the
  barriers, and the 2 KiB more Mosaic GPU reports at lowering for every
  config here."""
  align = lambda n: -(-n // 1024) * 1024  # noqa: E731
  bq, bk, stages = config.block_q, config.block_k, config.stages
  buffers = [
    NUM_CONSUMERS * bq * head_dim * 2,
    NUM_CONSUMERS * bq * bk * 2,
    NUM_CONSUMERS * bq * 4,
    NUM_CONSUMERS * bq * 4,
    stages * bk * head_dim * 2,
    stages * bk * head_dim * 2,
    stages * bk * 4,
    *([NUM_CONSUMERS * bq * 4] * 2 if band else []),
  ]
  barriers = 8 * (NUM_CONSUMERS + 4 * stages + 1)
  return sum(map(align, buffers)) + barriers + 2048


def _dims(shapes: Mapping[str, Any]) -> tuple[int, int]:
  """(D, keys per query row: Nk + Np) of the inputs' shapes (input name ->
  array or ShapeDtypeStruct; `k_prefix` may be absent or None; packed
  sequences' k `[Tk, Hkv, D]`: Tk)."""
  prefix = shapes.get("k_prefix")
  return int(shapes["q"].shape[-1]), int(shapes["k"].shape[-3]) + (0 if prefix is None else int(prefix.shape[1]))


def choose_config(shapes: Mapping[str, Any]) -> MosaicAttentionConfig:
  """128-key steps in a 2-slot ring (FA3's d128 shape, 197 KiB at D = 128);
  64-key steps when all keys fit in one."""
  _, keys = _dims(shapes)
  return MosaicAttentionConfig(block_k=64 if keys <= 64 else 128)


def candidate_configs(shapes: Mapping[str, Any]) -> list[MosaicAttentionConfig]:
  """The heuristic's first, then the other shapes that fit 227 KiB at the
  problem's D."""
  head_dim, _ = _dims(shapes)
  chosen = choose_config(shapes)
  sweep = [MosaicAttentionConfig(block_k=bk, stages=s) for bk in (128, 64) for s in (2, 3, 4)]
  fits = [c for c in sweep if shared_memory_bytes(c, head_dim) <= device.SHARED_MEMORY_PER_BLOCK]
  return list(dict.fromkeys([chosen, dataclasses.replace(chosen, ping_pong=False), *fits]))


def _kernel(
  *refs,
  config: MosaicAttentionConfig,
  logits: Logits,
  prefix_steps: int,
  group: int,
  band: bool,
  fault: str | None,
):
  # q, k, v, the prefix's k, v, key ids, query ids, the key steps per query
  # block and, with a band, its first key steps and each row's key interval
  # (lo, hi); out: o and lse.
  q_gmem, k_gmem, v_gmem, kp_gmem, vp_gmem, key_ids_gmem, query_ids_gmem, steps_gmem, *band_gmem = refs[:-2]
  o_gmem, lse_gmem = refs[-2:]
  first_gmem = band_gmem[0] if band else None
  bq, bk, stages = config.block_q, config.block_k, config.stages
  head_dim = q_gmem.shape[-1]
  head, q_block, batch = lax.axis_index("h"), lax.axis_index("q"), lax.axis_index("b")
  kv_head = kv_head_map(group)(head)  # grouped heads share their K/V

  # Key steps of this query block (the prefix's and the keys' up to the last
  # one some row sees; with a band from its first): producer and consumers
  # read the same range. Step g is the walk's use `g - first` of the ring.
  steps = steps_gmem[batch, q_block]
  first_step = None if first_gmem is None else first_gmem[batch, q_block]
  walked = (lambda g: g) if first_step is None else (lambda g: g - first_step)

  def scoped(
    q_smem,
    p_smem,
    lse_smem,
    qid_smem,
    k_smem,
    v_smem,
    kid_smem,
    q_barrier,
    k_full,
    v_full,
    k_empty,
    v_empty,
    turn,
    *band_smem,
  ):
    wg = lax.axis_index("wg")

    def meet():
      """A rendezvous of the two consumers (ping-pong only)."""
      if config.ping_pong:
        rendezvous(turn)

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
      plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

      def load(g, prefix_src, src, dst, barrier):
        """Step g's key block into `dst`: from the prefix for the first
        `prefix_steps` steps, then from the keys."""

        def copy(source, first):
          plgpu.copy_gmem_to_smem(source.at[batch, pl.ds((g - first) * bk, bk), kv_head], dst, barrier)

        if not prefix_steps:
          copy(src, 0)
          return
        pl.when(g < prefix_steps)(lambda: copy(prefix_src, 0))
        pl.when(g >= prefix_steps)(lambda: copy(src, prefix_steps))

      @pl.loop(0 if first_step is None else first_step, steps)
      def _step(g):
        slot = lax.rem(walked(g), stages)

        @pl.when(walked(g) >= stages)
        def _():
          plgpu.barrier_wait(k_empty.at[slot])

        load(g, kp_gmem, k_gmem, k_smem.at[slot], k_full.at[slot])
        plgpu.copy_gmem_to_smem(key_ids_gmem.at[batch, pl.ds(g * bk, bk)], kid_smem.at[slot], k_full.at[slot])

        @pl.when(walked(g) >= stages)
        def _():
          plgpu.barrier_wait(v_empty.at[slot])

        load(g, vp_gmem, v_gmem, v_smem.at[slot], v_full.at[slot])

      drain_releases(walked(steps), stages, k_empty, v_empty)

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
      plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
      q0 = (q_block * NUM_CONSUMERS + wg) * bq
      rows = pl.ds(q0, bq)
      plgpu.copy_gmem_to_smem(q_gmem.at[batch, rows, head], q_smem.at[wg], q_barrier.at[wg])
      plgpu.copy_gmem_to_smem(query_ids_gmem.at[batch, rows], qid_smem.at[wg], q_barrier.at[wg])
      for interval_gmem, interval_smem in zip(band_gmem[1:], band_smem):
        plgpu.copy_gmem_to_smem(interval_gmem.at[batch, rows], interval_smem.at[wg], q_barrier.at[wg])
      plgpu.barrier_wait(q_barrier.at[wg])
      row_layout = plgpu.Layout.WGMMA.reduce(1)
      query_ids = plgpu.load(qid_smem.at[wg], layout=row_layout)
      bounds = [plgpu.load(interval_smem.at[wg], layout=row_layout) for interval_smem in band_smem]
      acc, m, l = softmax_carry(bq, head_dim)

      def step(g, carry):
        acc, m, l = carry
        slot = lax.rem(walked(g), stages)
        plgpu.barrier_wait(k_full.at[slot])

        def scores(s_ref):
          plgpu.wgmma(s_ref, q_smem.at[wg], k_smem.at[slot].T)
          meet()  # the other consumer's softmax runs under this wgmma
          return s_ref[...]

        s, _ = logits.scores(pl.run_scoped(scores, plgpu.ACC((bq, bk), jnp.float32)))  # pyright: ignore[reportPrivateImportUsage] (public Pallas alias)
        if fault == "ids_released_early":
          plgpu.barrier_arrive(k_empty.at[slot])
        key_ids = plgpu.load(kid_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
        # The ids were read through the generic proxy; the producer's next TMA
        # (async proxy) into the slot must come after: commit_smem's fence.
        plgpu.commit_smem()
        if fault != "ids_released_early":
          plgpu.barrier_arrive(k_empty.at[slot])
        visible = lax.broadcast_in_dim(key_ids, s.shape, [1]) <= lax.broadcast_in_dim(query_ids, s.shape, [0])
        if band:  # each row's keys [lo, hi] (a band has no prefix steps)
          # Both sides, also where one is unbounded (lo = 0 under causal): one test
          # less spills 4 bytes at d128 on sm_90a (docs/perf/attention_features.md).
          key = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA) + g * bk
          lo, hi = (lax.broadcast_in_dim(x, s.shape, [0]) for x in bounds)
          visible = visible & (key >= lo)
          visible = visible & (key <= hi)
        p, correction, m_next, l_next = softmax_step(s, visible, m, l)
        if config.ping_pong:  # done with the softmax; the tensor cores are free once the other arrives
          plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(v_full.at[slot])
        if config.ping_pong:
          plgpu.barrier_wait(turn)

        # P goes through shared memory (the CPU interpreter's wgmma reads
        # both operands from there); the previous step's P V has completed.
        p_smem[wg] = p.astype(p_smem.dtype)
        plgpu.commit_smem()

        def values(pv_ref):
          plgpu.wgmma(pv_ref, p_smem.at[wg], v_smem.at[slot])
          return pv_ref[...]

        pv = pl.run_scoped(values, plgpu.ACC((bq, head_dim), jnp.float32))  # pyright: ignore[reportPrivateImportUsage] (public Pallas alias)
        plgpu.barrier_arrive(v_empty.at[slot])
        return acc * lax.broadcast_in_dim(correction, acc.shape, [0]) + pv, m_next, l_next

      pl.when(wg == 1)(meet)  # consumer 1 starts one rendezvous behind
      acc, m, l = lax.fori_loop(0 if first_step is None else first_step, steps, step, (acc, m, l))
      pl.when(wg == 0)(meet)  # ... and consumer 0 makes up for it at the end
      seen = l > 0.0
      inverse = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
      # O reuses the Q tile: the last S wgmma that read it has completed.
      q_smem[wg] = (acc * lax.broadcast_in_dim(inverse, acc.shape, [0])).astype(q_smem.dtype)
      lse_smem[wg] = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), jnp.inf)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem.at[wg], o_gmem.at[batch, rows, head])
      plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_gmem.at[batch, head, rows])
      plgpu.wait_smem_to_gmem(0)

  dtype = q_gmem.dtype
  pl.run_scoped(
    scoped,
    plgpu.SMEM((NUM_CONSUMERS, bq, head_dim), dtype, transforms=WGMMA_TRANSFORMS),
    plgpu.SMEM((NUM_CONSUMERS, bq, bk), dtype, transforms=WGMMA_TRANSFORMS),
    plgpu.SMEM((NUM_CONSUMERS, bq), jnp.float32),
    plgpu.SMEM((NUM_CONSUMERS, bq), jnp.int32),
    plgpu.SMEM((stages, bk, head_dim), dtype, transforms=WGMMA_TRANSFORMS),
    plgpu.SMEM((stages, bk, head_dim), dtype, transforms=WGMMA_TRANSFORMS),
    plgpu.SMEM((stages, bk), jnp.int32),
    plgpu.Barrier(num_arrivals=4 if band else 2, num_barriers=NUM_CONSUMERS),
    plgpu.Barrier(num_arrivals=2, num_barriers=stages),
    plgpu.Barrier(num_arrivals=1, num_barriers=stages),
    plgpu.Barrier(num_arrivals=1 if fault == "release_once" else NUM_CONSUMERS, num_barriers=stages),
    plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages),
    plgpu.Barrier(num_arrivals=1 if fault == "turn_once" else NUM_CONSUMERS),
    *([plgpu.SMEM((NUM_CONSUMERS, bq), jnp.int32)] * 2 if band else []),
    collective_axes="wg",
  )


_HIDDEN = INVISIBLE_SEGMENT  # a key id no query reaches
_EVERYONE = jnp.iinfo(jnp.int32).min  # a key id every query reaches (prefix keys)


def _key_ids(batch, kv_len, steps, block, key_valid, segment_ids):
  """[B, steps * block] int32: key j is visible to query i iff
  key_id[j] <= query_id[i]. Keys past `kv_len` and hidden keys get
  `_HIDDEN`; the others their segment id, or 0 without segments."""
  ids = jnp.zeros((batch, kv_len), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
  if key_valid is not None:
    ids = jnp.where(key_valid, ids, _HIDDEN)
  return jnp.pad(ids, ((0, 0), (0, steps * block - kv_len)), constant_values=_HIDDEN)


def _band_rows(band: Window | None, cu_seqlens_q, cu_seqlens_k, *, batch: int, q_len: int, kv_len: int):
  """`(rows_lo, rows_hi)` `[B, Nq]` int32: each query row's key interval
  under `band` (`keys.band_intervals`), or `(None, None)` without one."""
  if band is None:
    return None, None
  lo, hi = band_intervals(band, cu_seqlens_q, cu_seqlens_k, q_len=q_len, kv_len=kv_len)
  return jnp.broadcast_to(lo, (batch, q_len)), jnp.broadcast_to(hi, (batch, q_len))


def _band_steps(rows_lo, rows_hi, *, kv_len: int, cta_rows: int, block_k: int):
  """`(first, end)` `[B, q blocks]` key steps of each query block of
  `cta_rows` rows under a band (`rows_lo`, `rows_hi` `[B, q blocks *
  cta_rows]`, the rows' key intervals): every key a row sees lies in steps
  `[first, end)`; a block whose rows see nothing gets an empty range."""
  batch = rows_lo.shape[0]
  lo, hi = (x.reshape(batch, -1, cta_rows) for x in (rows_lo, rows_hi))
  sees = lo <= hi
  first = jnp.min(jnp.where(sees, lo, kv_len), axis=2) // block_k
  end = (jnp.max(jnp.where(sees, hi + 1, 0), axis=2) + block_k - 1) // block_k
  return first, jnp.maximum(end, first)


def _forward(
  q,
  k,
  v,
  k_prefix,
  v_prefix,
  key_valid,
  segment_ids,
  rows_lo=None,
  rows_hi=None,
  *,
  sm_scale: float,
  config: MosaicAttentionConfig,
  interpret: bool,
  window: Window | None = None,
  softcap: float | None = None,
  fault: str | None = None,
):
  """(o, lse) of one launch; `window`: the band, `rows_lo`, `rows_hi`
  `[B, Nq]` its key interval of each query row (`keys.band_intervals`; not
  with prefix keys); `fault` (tests only, one of `FAULTS`) breaks the
  synchronization on purpose."""
  if fault is not None and fault not in FAULTS:
    raise ValueError(f"fault must be None or one of {FAULTS}, got {fault!r}")
  batch, q_len, heads, head_dim = q.shape
  kv_len, bk = k.shape[1], config.block_k
  prefix_len = 0 if k_prefix is None else k_prefix.shape[1]
  prefix_steps, kv_steps = -(-prefix_len // bk), -(-kv_len // bk)
  key_ids = _key_ids(batch, kv_len, kv_steps, bk, key_valid, segment_ids)
  if prefix_steps:
    prefix_ids = jnp.where(jnp.arange(prefix_steps * bk) < prefix_len, _EVERYONE, _HIDDEN)
    key_ids = jnp.concatenate([jnp.broadcast_to(prefix_ids, (batch, prefix_steps * bk)), key_ids], axis=1)
  cta_rows = NUM_CONSUMERS * config.block_q
  q_blocks = -(-q_len // cta_rows)
  # Key blocks past the last one some row of a query block sees are skipped
  # (tight for a valid prefix of keys and nondecreasing segment ids).
  key_blocks = jnp.full((batch, q_blocks), kv_steps, jnp.int32)
  if key_valid is not None or segment_ids is not None:
    key_blocks = key_block_limits(
      key_valid, segment_ids, batch=batch, q_len=q_len, kv_len=kv_len, block_q=cta_rows, block_k=bk
    )[..., 1]
  steps = prefix_steps + key_blocks
  band = []
  if window is not None:  # only the band's key blocks: [first, end) of each query block
    assert rows_lo is not None and rows_hi is not None
    pad = ((0, 0), (0, q_blocks * cta_rows - q_len))
    rows_lo = jnp.pad(rows_lo, pad, constant_values=kv_len)  # rows past Nq see nothing
    rows_hi = jnp.pad(rows_hi, pad, constant_values=-1)
    first, end = _band_steps(rows_lo, rows_hi, kv_len=kv_len, cta_rows=cta_rows, block_k=bk)
    steps = jnp.minimum(steps, end)
    band = [jnp.minimum(first, steps), rows_lo, rows_hi]
  # Rows past Nq see no key (their output is never stored).
  query_ids = jnp.zeros((batch, q_len), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
  query_ids = jnp.pad(query_ids, ((0, 0), (0, q_blocks * cta_rows - q_len)), constant_values=_EVERYONE)
  # O is stored from the (8, 64)-tiled Q tile, so O (and lse, whose rows
  # TMA needs 16-byte aligned) get a multiple of 8 rows, sliced after.
  rows = -(-q_len // ROW_ALIGN) * ROW_ALIGN
  kernel = compat.kernel(
    functools.partial(
      _kernel,
      config=config,
      logits=Logits.of(float(sm_scale), softcap),
      prefix_steps=prefix_steps,
      group=heads // k.shape[2],
      band=window is not None,
      fault=fault,
    ),
    out_type=(
      jax.ShapeDtypeStruct((batch, rows, heads, head_dim), q.dtype),
      jax.ShapeDtypeStruct((batch, heads, rows), jnp.float32),
    ),
    grid=(heads, q_blocks, batch),
    grid_names=("h", "q", "b"),
    num_threads=NUM_CONSUMERS + 1,
    thread_name="wg",
    name=__name__,
    interpret=interpret,
  )
  k, v = pad_rows(k, 1), pad_rows(v, 1)
  # Without prefix keys the prefix operands are k and v again, never read.
  k_prefix, v_prefix = (k, v) if k_prefix is None else (pad_rows(k_prefix, 1), pad_rows(v_prefix, 1))
  o, lse = kernel(pad_rows(q, 1), k, v, k_prefix, v_prefix, key_ids, query_ids, steps, *band)
  return (o, lse) if rows == q_len else (o[:, :q_len], lse[..., :q_len])


@functools.partial(jax.jit, static_argnames=("sm_scale", "causal", "window", "softcap", "config", "interpret"))
def flash_attention_forward(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  key_valid: jax.Array | None = None,
  k_prefix: jax.Array | None = None,
  v_prefix: jax.Array | None = None,
  segment_ids: jax.Array | None = None,
  sm_scale: float | None = None,
  causal: bool = False,
  window: tuple[int | None, int | None] | None = None,
  softcap: float | None = None,
  cu_seqlens_q: jax.Array | None = None,
  cu_seqlens_k: jax.Array | None = None,
  config: MosaicAttentionConfig | None = None,
  interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
  """`(o, lse)` of `softmax(q k^T * sm_scale) v` over the visible keys.

  q `[B, Nq, H, D]`, k and v `[B, Nk, Hkv, D]` (Hkv divides H: query head
  h reads key/value head `h // (H / Hkv)`), bf16, D 64 or 128. The masks,
  key sources and features of
  `pallas_kernels.flash_attention.triton.flash_attention`: `key_valid
  [B, Nk]` (False hides key j); `k_prefix`, `v_prefix` `[B, Np, Hkv, D]`
  (keys `concat(k_prefix, k)`, every prefix key visible); `segment_ids
  [B, Nq]` int32 with Nk == Nq (key j visible to query i iff
  `segment_ids[j] <= segment_ids[i]`; ids must stay below 2**31 - 1, the
  id this kernel gives hidden keys); `causal`, `window=(left, right)`
  (bottom-right aligned), `softcap`, and packed sequences (`cu_seqlens_q`,
  `cu_seqlens_k` `[S + 1]`, q `[T, H, D]`, k, v `[Tk, Hkv, D]`,
  key_valid `[Tk]`). `sm_scale` a static float, default `D ** -0.5`.

  Returns o `[B, Nq, H, D]` in q's dtype (rows that see no key are 0) and
  lse `[B, H, Nq]` f32 (log2 of the sum of exp2 of the scores scaled by
  `sm_scale * LOG2_E`, +inf for a row that sees no key); packed, o
  `[T, H, D]` and lse `[H, T]`. Any B, Nq, Nk, Np >= 0 (no query: empty;
  no key: zeros and +inf).
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
  check_supported(q, sm_scale)
  batch, q_len, heads, head_dim = q.shape
  kv_len = k.shape[1]
  repack = functools.partial(packed_outputs, packed=packed, return_lse=True, natural=False)
  if not (batch and q_len and heads and kv_len):
    return repack(jnp.zeros(q.shape, q.dtype), jnp.full((batch, heads, q_len), jnp.inf, jnp.float32))
  band = band_window(causal, window, packed)
  rows_lo, rows_hi = _band_rows(band, cu_seqlens_q, cu_seqlens_k, batch=batch, q_len=q_len, kv_len=kv_len)
  return repack(
    *_checked_forward(
      q,
      k,
      v,
      k_prefix,
      v_prefix,
      key_valid,
      segment_ids,
      rows_lo,
      rows_hi,
      sm_scale=head_dim**-0.5 if sm_scale is None else float(sm_scale),
      window=band,
      softcap=None if softcap is None else float(softcap),
      config=config,
      interpret=interpret,
    )
  )


@functools.partial(jax.jit, static_argnames=("sm_scale", "window", "softcap", "config", "interpret"))
def _checked_forward(
  q,
  k,
  v,
  k_prefix,
  v_prefix,
  key_valid,
  segment_ids,
  rows_lo,
  rows_hi,
  *,
  sm_scale: float,
  window: Window | None,
  softcap: float | None,
  config: MosaicAttentionConfig | None,
  interpret: bool | None,
):
  """`flash_attention_forward` past its checks: inputs checked and
  supported, key sources resolved (`key_sources`), packed sequences as one
  batch row, a band (`window`) as its rows' key intervals `rows_lo`,
  `rows_hi` `[B, Nq]` (`keys.band_intervals`), at least one query and one
  key, `sm_scale` a float."""
  head_dim = q.shape[-1]
  config = config or choose_config({"q": q, "k": k, "k_prefix": k_prefix})
  if shared_memory_bytes(config, head_dim, band=rows_lo is not None) > device.SHARED_MEMORY_PER_BLOCK:
    raise ValueError(
      f"{config} needs {shared_memory_bytes(config, head_dim, band=rows_lo is not None)} bytes of shared memory "
      f"at D={head_dim}; "
      f"the limit is {device.SHARED_MEMORY_PER_BLOCK} (fewer stages or a smaller block_k)"
    )
  if key_valid is not None:
    # A hidden key's probability is 0, but 0 * NaN is NaN in the P V product:
    # non-finite values of hidden keys are zeroed first (a copy of v, made
    # only when v holds one).
    hidden = ~key_valid.astype(bool)[:, :, None, None]
    v = lax.cond(jnp.all(jnp.isfinite(v)), lambda v: v, lambda v: jnp.where(hidden, jnp.zeros_like(v), v), v)
  return _forward(
    q,
    k,
    v,
    k_prefix,
    v_prefix,
    key_valid,
    segment_ids,
    rows_lo,
    rows_hi,
    sm_scale=sm_scale,
    window=window,
    softcap=softcap,
    config=config,
    interpret=resolve_interpret(interpret),
  )


def check_supported(q: jax.Array, sm_scale: Any) -> None:
  """Raises `Unsupported` for inputs this kernel does not take: q (and k, v)
  not bf16, a head dim other than `HEAD_DIMS`, or an `sm_scale` that is not
  a Python number (the scale is compiled into the kernel)."""
  if q.dtype != jnp.bfloat16:
    raise Unsupported(f"q, k, v must be bfloat16 for the Mosaic GPU attention, got {q.dtype}")
  if q.shape[-1] not in HEAD_DIMS:
    raise Unsupported(f"head dim D={q.shape[-1]} must be one of {HEAD_DIMS} for the Mosaic GPU attention")
  if sm_scale is not None and not isinstance(sm_scale, (int, float)):
    raise Unsupported(
      f"sm_scale must be a Python float (or None) for the Mosaic GPU attention, got {type(sm_scale).__name__}"
    )


class _Static(NamedTuple):
  sm_scale: float
  config: MosaicAttentionConfig | None
  backward_config: FlashAttentionBwdConfig  # fitted
  interpret: bool | None
  window: Window | None = None
  softcap: float | None = None
  with_lse: bool = False  # the primal returns (o, lse) (lse base 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _attention(q, k, v, k_prefix, v_prefix, key_valid, segment_ids, rows_lo, rows_hi, static: _Static):
  out, _ = _attention_fwd(q, k, v, k_prefix, v_prefix, key_valid, segment_ids, rows_lo, rows_hi, static)
  return out


def _attention_fwd(q, k, v, k_prefix, v_prefix, key_valid, segment_ids, rows_lo, rows_hi, static: _Static):
  o, lse = _checked_forward(
    q,
    k,
    v,
    k_prefix,
    v_prefix,
    key_valid,
    segment_ids,
    rows_lo,
    rows_hi,
    sm_scale=static.sm_scale,
    window=static.window,
    softcap=static.softcap,
    config=static.config,
    interpret=static.interpret,
  )
  # The Triton backward takes a packed band's rows (an unpacked one comes from iotas).
  packed = static.window is not None and static.window.packed
  rows = (rows_lo, rows_hi) if packed else (None, None)
  return ((o, lse) if static.with_lse else o), (q, k, v, k_prefix, v_prefix, key_valid, segment_ids, *rows, o, lse)


def _attention_bwd(static: _Static, residuals, cotangent):
  # The Triton backward recomputes each probability as exp2(s - lse) from
  # this kernel's lse: both are base 2 at the scale sm_scale * LOG2_E, +inf
  # for a row that sees no key (`flash_attention_forward`).
  q, k, v, k_prefix, v_prefix, key_valid, segment_ids, rows_lo, rows_hi, o, lse = residuals
  do, dlse = cotangent if static.with_lse else (cotangent, None)
  scale = jnp.full((1,), static.sm_scale, jnp.float32)
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
    interpret=resolve_interpret(static.interpret),
    need_dq=True,
    need_dkv=True,
    need_dprefix=k_prefix is not None,
    need_dscale=False,
  )
  return g.dq, g.dk, g.dv, g.dk_prefix, g.dv_prefix, None, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


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
  causal: bool = False,
  window: tuple[int | None, int | None] | None = None,
  softcap: float | None = None,
  cu_seqlens_q: jax.Array | None = None,
  cu_seqlens_k: jax.Array | None = None,
  return_lse: bool = False,
  config: MosaicAttentionConfig | None = None,
  backward_config: FlashAttentionBwdConfig | None = None,
  interpret: bool | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """The output of `flash_attention_forward` (its contract), with
  `return_lse` also its lse in natural log (`[B, H, Nq]`, packed `[H, T]`,
  +inf for a lonely row): the forward of the Triton kernel's
  `flash_attention` on the inputs this kernel takes (`check_supported`:
  bf16, D 64 or 128, a static scale), `Unsupported` otherwise so that
  `backend="pallas"` falls back.

  Differentiable in q, k, v, the prefix and the lse (`jax.custom_vjp`):
  the backward is the Triton kernel's (`triton_bwd.attention_backward`,
  tiled by `backward_config`, None = its heuristic) from this kernel's o
  and lse; the scale is static, so it has no gradient. Hidden keys get
  exactly zero gradients."""
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
  check_supported(q, sm_scale)
  batch, q_len, heads, head_dim = q.shape
  kv_len = k.shape[1]
  finish = functools.partial(packed_outputs, packed=packed, return_lse=return_lse)
  if not (batch and q_len and heads and kv_len):
    return finish(jnp.zeros(q.shape, q.dtype), jnp.full((batch, heads, q_len), jnp.inf, jnp.float32))
  longest = max(kv_len, 0 if k_prefix is None else k_prefix.shape[1])
  backward_config = backward_config_for(
    backward_config, batch=batch, heads=heads, q_len=q_len, kv_len=longest, head_dim=head_dim
  )
  band = band_window(causal, window, packed)
  rows_lo, rows_hi = _band_rows(band, cu_seqlens_q, cu_seqlens_k, batch=batch, q_len=q_len, kv_len=kv_len)
  static = _Static(
    head_dim**-0.5 if sm_scale is None else float(sm_scale),
    config,
    backward_config,
    interpret,
    band,
    None if softcap is None else float(softcap),
    return_lse,
  )
  out = _attention(q, k, v, k_prefix, v_prefix, key_valid, segment_ids, rows_lo, rows_hi, static)
  return finish(*out) if return_lse else finish(out, None)
