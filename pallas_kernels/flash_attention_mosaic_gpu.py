"""Flash attention forward on Mosaic GPU (Hopper-native), FA3-style: dense
non-causal attention with a per-key visibility mask.

Contract (the dense part of `pallas_kernels.flash_attention`'s forward):
q `[B, Nq, H, D]`, k and v `[B, Nk, H, D]` bf16 with D 64 or 128,
optional `key_valid [B, Nk]` (False hides key j of batch row b: whatever it
holds reaches no output), `softmax(q k^T * sm_scale) v` with the online
softmax of `pallas_kernels.online_softmax` in base 2 (scores scaled by
`sm_scale * LOG2_E`, hidden keys selected away to -inf, a row that has seen
nothing subtracts 0 so its probabilities are 0), the probabilities rounded
to bf16 for the value product, the output rounded once; a row that sees no
key outputs 0 and has lse +inf. Also returns `lse [B, H, Nq]` (base 2, the
forward's scale), what a backward recomputes the probabilities from.
Prefix keys and block-causal segments are not implemented here (they stay on
the Triton kernel).

Structure: grid (H, query blocks of 2 * block_q, B); three warpgroups per CTA.

- warpgroup 2, the producer (`setmaxnreg` 40), streams K, V and the key mask
  of each `block_k` step into a ring of `stages` slots with TMA;
- warpgroups 0 and 1, the consumers (`setmaxnreg` 232), each own `block_q`
  query rows: Q once by TMA, then per step S = Q K^T (wgmma), the masked
  online-softmax update in registers, and O += P V (wgmma; P goes through a
  per-consumer shared-memory tile because the CPU interpreter's wgmma reads
  both operands from shared memory); the epilogue divides by the row sums
  and stores O and lse through shared memory with TMA.

Ragged sizes: keys past Nk are hidden by the mask, which the wrapper builds
as `[B, steps * block_k]` f32 (1 visible, 0 hidden or out of range; a few
bytes per key). Mosaic GPU's TMA views q, k, v and O in 8-row tiles, so an
Nq or Nk that is not a multiple of 8 pads that array by < 8 rows (and O and
lse are sliced back to Nq); a multiple of 8 needs no copy. Rows past the
sequence within a tile are zero-filled on load and clipped on store.

Synchronization (interpret mode does not check asynchrony):

- `k_full[s]` (2 arrivals: the K copy and the mask copy) and `v_full[s]`
  (1: the V copy) guard slot s's data; both consumers wait on them before
  reading K/mask or V of the slot.
- `k_empty[s]` and `v_empty[s]` (2 arrivals, one per consumer) guard reuse.
  A consumer releases K and the mask of step g after its S wgmma has
  completed (reading the accumulator waits for it) and the mask is in
  registers; it releases V after its P V wgmma completed (same). The
  producer waits on `k_empty[s]` before refilling K/mask of step g >= stages
  and on `v_empty[s]` before V, and at the end waits for the last release of
  every slot it waited on, so it observes every completion.
- Parity: use u of slot s completes phase u of each of the four barriers;
  every waiter waits on every phase in order (the consumers on all of
  `k_full`/`v_full`, the producer on all of `k_empty`/`v_empty` but each
  slot's first, which nothing precedes).
- `q_barrier[w]` guards consumer w's Q tile (one TMA, one wait); the
  epilogue overwrites it with O after the last S wgmma that read it has
  completed. P tile w is
  written by consumer w only, after its previous P V wgmma completed, and
  `commit_smem()` makes the writes visible to the wgmma. Epilogue:
  each consumer writes its own O and lse slots, `commit_smem()`, TMA stores,
  and waits for them before exiting.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels import device
from pallas_kernels import mosaic_gpu_compat as compat
from pallas_kernels.mosaic_gpu_common import (CONSUMER_REGISTERS, NUM_CONSUMERS, PRODUCER_REGISTERS, ROW_ALIGN,
                                              WGMMA_TRANSFORMS, pad_rows)
from pallas_kernels.common import resolve_interpret
from pallas_kernels.config_rules import KernelConfig, Rule, at_least, field, one_of
from pallas_kernels.online_softmax import LOG2_E

HEAD_DIMS = (64, 128)

# Test-only sync fault (`_forward(fault=...)`).
FAULTS = ("release_once",)


@dataclasses.dataclass(frozen=True)
class MosaicAttentionConfig(KernelConfig):
  """`block_q` query rows per consumer warpgroup (a CTA has two), keys walked
  `block_k` at a time through a ring of `stages` slots."""
  block_q: int = field(64, one_of(64))
  block_k: int = field(128, one_of(64, 128))
  stages: int = field(2, at_least(2))


def shared_memory_bytes(config: MosaicAttentionConfig, head_dim: int) -> int:
  """The scratch Mosaic GPU allocates: Q (then O) and P tiles of both
  consumers, K, V and the key mask per slot, the lse rows (bf16 operands,
  f32 mask and lse), each buffer aligned to 1 KiB (the 128-byte swizzle's
  period), the barriers, and the 2 KiB more Mosaic GPU reports at lowering
  for every config here."""
  align = lambda n: -(-n // 1024) * 1024  # noqa: E731
  bq, bk, stages = config.block_q, config.block_k, config.stages
  buffers = [NUM_CONSUMERS * bq * head_dim * 2, NUM_CONSUMERS * bq * bk * 2, NUM_CONSUMERS * bq * 4, stages * bk * head_dim * 2, stages * bk * head_dim * 2, stages * bk * 4]
  barriers = 8 * (NUM_CONSUMERS + 4 * stages)
  return sum(map(align, buffers)) + barriers + 2048


def choose_config(head_dim: int, kv_len: int) -> MosaicAttentionConfig:
  """128-key steps in a 2-slot ring (FA3's d128 shape); 64-key steps when the
  keys fit in one 64-key step."""
  del head_dim
  return MosaicAttentionConfig(block_k=64 if kv_len <= 64 else 128)


def candidate_configs(head_dim: int, kv_len: int) -> list[MosaicAttentionConfig]:
  """The heuristic's first, then the other shapes that fit 227 KiB."""
  chosen = choose_config(head_dim, kv_len)
  sweep = [MosaicAttentionConfig(block_k=bk, stages=s) for bk in (128, 64) for s in (2, 3, 4)]
  fits = [c for c in sweep if shared_memory_bytes(c, head_dim) <= device.SHARED_MEMORY_PER_BLOCK]
  return list(dict.fromkeys([chosen, *fits]))


def _kernel(q_gmem, k_gmem, v_gmem, mask_gmem, o_gmem, lse_gmem, *, config: MosaicAttentionConfig,
            qk_scale: float, kv_steps: int, fault: str | None):
  bq, bk, stages = config.block_q, config.block_k, config.stages
  head_dim = q_gmem.shape[-1]
  head, q_block, batch = lax.axis_index("h"), lax.axis_index("q"), lax.axis_index("b")

  def scoped(q_smem, p_smem, lse_smem, k_smem, v_smem, mask_smem, q_barrier, k_full, v_full, k_empty,
             v_empty):
    wg = lax.axis_index("wg")

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
      plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

      @pl.loop(0, kv_steps)
      def _step(g):
        slot = lax.rem(g, stages)
        keys = pl.ds(g * bk, bk)

        @pl.when(g >= stages)
        def _():
          plgpu.barrier_wait(k_empty.at[slot])

        plgpu.copy_gmem_to_smem(k_gmem.at[batch, keys, head], k_smem.at[slot], k_full.at[slot])
        plgpu.copy_gmem_to_smem(mask_gmem.at[batch, keys], mask_smem.at[slot], k_full.at[slot])

        @pl.when(g >= stages)
        def _():
          plgpu.barrier_wait(v_empty.at[slot])

        plgpu.copy_gmem_to_smem(v_gmem.at[batch, keys, head], v_smem.at[slot], v_full.at[slot])

      @pl.loop(max(kv_steps - stages, stages), kv_steps)
      def _drain(g):
        plgpu.barrier_wait(k_empty.at[lax.rem(g, stages)])
        plgpu.barrier_wait(v_empty.at[lax.rem(g, stages)])

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
      plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
      q0 = (q_block * NUM_CONSUMERS + wg) * bq
      rows = pl.ds(q0, bq)
      plgpu.copy_gmem_to_smem(q_gmem.at[batch, rows, head], q_smem.at[wg], q_barrier.at[wg])
      plgpu.barrier_wait(q_barrier.at[wg])
      row_layout = plgpu.Layout.WGMMA.reduce(1)
      m = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), row_layout)
      l = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row_layout)
      acc = plgpu.layout_cast(jnp.zeros((bq, head_dim), jnp.float32), plgpu.Layout.WGMMA)

      def step(g, carry):
        acc, m, l = carry
        slot = lax.rem(g, stages)
        plgpu.barrier_wait(k_full.at[slot])

        def scores(s_ref):
          plgpu.wgmma(s_ref, q_smem.at[wg], k_smem.at[slot].T)
          return s_ref[...]

        s = pl.run_scoped(scores, plgpu.ACC((bq, bk), jnp.float32)) * qk_scale
        visible = plgpu.load(mask_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0)) > 0.0
        plgpu.barrier_arrive(k_empty.at[slot])
        # The online softmax step of `online_softmax.online_softmax_step`.
        s = jnp.where(lax.broadcast_in_dim(visible, s.shape, [1]), s, -jnp.inf)
        m_next = jnp.maximum(m, s.max(axis=1))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        correction = jnp.exp2(m - m_safe)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
        l_next = correction * l + p.sum(axis=1)
        plgpu.barrier_wait(v_full.at[slot])

        # P goes through shared memory (the CPU interpreter's wgmma reads
        # both operands from there); the previous step's P V has completed.
        p_smem[wg] = p.astype(p_smem.dtype)
        plgpu.commit_smem()

        def values(pv_ref):
          plgpu.wgmma(pv_ref, p_smem.at[wg], v_smem.at[slot])
          return pv_ref[...]

        pv = pl.run_scoped(values, plgpu.ACC((bq, head_dim), jnp.float32))
        plgpu.barrier_arrive(v_empty.at[slot])
        return acc * lax.broadcast_in_dim(correction, acc.shape, [0]) + pv, m_next, l_next

      acc, m, l = lax.fori_loop(0, kv_steps, step, (acc, m, l))
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
      plgpu.SMEM((stages, bk, head_dim), dtype, transforms=WGMMA_TRANSFORMS),
      plgpu.SMEM((stages, bk, head_dim), dtype, transforms=WGMMA_TRANSFORMS),
      plgpu.SMEM((stages, bk), jnp.float32),
      plgpu.Barrier(num_barriers=NUM_CONSUMERS),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      plgpu.Barrier(num_arrivals=1, num_barriers=stages),
      plgpu.Barrier(num_arrivals=1 if fault == "release_once" else NUM_CONSUMERS, num_barriers=stages),
      plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages),
      collective_axes="wg",
  )


def _forward(q, k, v, key_valid, *, sm_scale: float, config: MosaicAttentionConfig, interpret: bool,
             fault: str | None = None):
  """(o, lse) of one launch; `fault` (tests only, one of `FAULTS`) breaks the
  synchronization on purpose."""
  if fault is not None and fault not in FAULTS:
    raise ValueError(f"fault must be None or one of {FAULTS}, got {fault!r}")
  batch, q_len, heads, head_dim = q.shape
  kv_len = k.shape[1]
  kv_steps = -(-kv_len // config.block_k)
  keys = jnp.arange(kv_steps * config.block_k) < kv_len
  visible = keys[None, :] if key_valid is None else keys[None, :] & jnp.pad(
      key_valid, ((0, 0), (0, kv_steps * config.block_k - kv_len)))
  mask = jnp.broadcast_to(visible, (batch, kv_steps * config.block_k)).astype(jnp.float32)
  cta_rows = NUM_CONSUMERS * config.block_q
  # O is stored from the (8, 64)-tiled Q tile, so O (and lse, whose rows
  # TMA needs 16-byte aligned) get a multiple of 8 rows, sliced after.
  rows = -(-q_len // ROW_ALIGN) * ROW_ALIGN
  kernel = plgpu.kernel(
      functools.partial(_kernel, config=config, qk_scale=float(sm_scale) * LOG2_E, kv_steps=kv_steps,
                        fault=fault),
      out_type=(jax.ShapeDtypeStruct((batch, rows, heads, head_dim), q.dtype),
                jax.ShapeDtypeStruct((batch, heads, rows), jnp.float32)),
      grid=(heads, -(-q_len // cta_rows), batch),
      grid_names=("h", "q", "b"),
      num_threads=NUM_CONSUMERS + 1,
      thread_name="wg",
      **compat.interpret_kwargs(interpret),
  )
  o, lse = kernel(pad_rows(q, 1), pad_rows(k, 1), pad_rows(v, 1), mask)
  return (o, lse) if rows == q_len else (o[:, :q_len], lse[..., :q_len])


@functools.partial(jax.jit, static_argnames=("sm_scale", "config", "interpret"))
def flash_attention_forward(q: jax.Array, k: jax.Array, v: jax.Array, *, key_valid: jax.Array | None = None,
                            sm_scale: float | None = None, config: MosaicAttentionConfig | None = None,
                            interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """`(o, lse)`: o `[B, Nq, H, D]` in q's dtype, lse `[B, H, Nq]` f32 (base
  2 of the scores scaled by `sm_scale * LOG2_E`, +inf for a row that sees no
  key). `sm_scale` a static float, default `D ** -0.5`. Any B, Nq, Nk >= 0
  (no query: empty; no key: zeros and +inf)."""
  batch, q_len, heads, head_dim = q.shape
  kv_len = k.shape[1]
  if k.shape != (batch, kv_len, heads, head_dim) or v.shape != k.shape:
    raise ValueError(f"k {k.shape} / v {v.shape} do not match q {q.shape}")
  if not q.dtype == k.dtype == v.dtype == jnp.bfloat16:
    raise ValueError(f"q, k, v must be bfloat16, got {q.dtype}, {k.dtype}, {v.dtype}")
  if head_dim not in HEAD_DIMS:
    raise ValueError(f"head dim D={head_dim} must be one of {HEAD_DIMS}")
  if key_valid is not None and key_valid.shape != (batch, kv_len):
    raise ValueError(f"key_valid {key_valid.shape} != {(batch, kv_len)}")
  lse_shape = (batch, heads, q_len)
  if not (batch and q_len and heads):
    return jnp.zeros(q.shape, q.dtype), jnp.full(lse_shape, jnp.inf, jnp.float32)
  if not kv_len:
    return jnp.zeros(q.shape, q.dtype), jnp.full(lse_shape, jnp.inf, jnp.float32)
  config = config or choose_config(head_dim, kv_len)
  if shared_memory_bytes(config, head_dim) > device.SHARED_MEMORY_PER_BLOCK:
    raise ValueError(f"{config} needs {shared_memory_bytes(config, head_dim)} bytes of shared memory at D={head_dim}; "
                     f"the limit is {device.SHARED_MEMORY_PER_BLOCK} (fewer stages or a smaller block_k)")
  scale = head_dim ** -0.5 if sm_scale is None else sm_scale
  if key_valid is not None:
    # A hidden key's probability is 0, but 0 * NaN is NaN in the P V product:
    # non-finite values of hidden keys are zeroed first (a copy of v, made
    # only when v holds one).
    hidden = ~key_valid.astype(bool)[:, :, None, None]
    v = lax.cond(jnp.all(jnp.isfinite(v)), lambda v: v, lambda v: jnp.where(hidden, jnp.zeros_like(v), v), v)
  return _forward(q, k, v, key_valid, sm_scale=scale, config=config, interpret=resolve_interpret(interpret))
