"""Dense GEMM on Mosaic GPU (Hopper-native): C[M,N] = A[M,K] @ B[N,K]^T.

The same contract as the Triton kernel (`pallas_kernels.dense_gemm`, layout
"nt"): A bf16 activations, B the bf16 weight as stored (`[out, in]`), fp32
accumulation in the tensor cores, C rounded to bf16 once.

Structure (one CTA per SM, three warpgroups):

- a persistent grid of `config.grid` CTAs (`None`: the device's SM count).
  CTA `p` computes the output tiles `p, p + grid, p + 2 grid, ...` of the
  `block_m x block_n` tiling of C, numbered in the grouped (L2-friendly)
  order of the Triton kernel: `group_m` M-tiles share each sweep over N.
- warpgroup 2, the producer (`setmaxnreg` down to `PRODUCER_REGISTERS`),
  streams the A and B tiles of every K step of every tile of its CTA into a
  ring of `stages` shared-memory slots with TMA (`copy_gmem_to_smem`).
- warpgroups 0 and 1, the consumers (`setmaxnreg` up to
  `CONSUMER_REGISTERS`), each own half of the CTA tile (its upper and lower
  rows, `split="m"`, or its left and right columns, `split="n"`) and
  accumulate it with async `wgmma` in registers; the epilogue rounds to bf16,
  writes `block / 2 x epilogue_n` pieces into two shared-memory slots per
  consumer and stores them with TMA (`copy_smem_to_gmem`) while the next
  tile's main loop runs.

Operands live in shared memory in the wgmma layout: (8, 64)-element tiles with
the 128-byte swizzle, B as stored ([block_n, block_k]) and read transposed by
wgmma. M and N need not be multiples of block_m and block_n: rows of A and B
past M and N read as zeros (TMA out-of-bounds fill) and C past them is not
written (TMA stores clip at the array's bounds), with no padded copy.
Mosaic GPU's TMA views a copied array in the tiles of its shared-memory
side, though: (8, 64) for the wgmma operands, so an M that is not a multiple
of 8 (4125 of the recorded M) pads A by < 8 zero rows (one copy of A); the
epilogue's pieces use 1-row tiles, so C is written in place at any M. M = 0 launches nothing. The same tiles need
N to be a multiple of 64 and K one of `block_k` (`check_problem` raises
`Unsupported` otherwise); the recorded (N, K) are.

Synchronization (the argument; interpret mode does not check asynchrony, so
this is what makes the kernel correct on the GPU):

- Ring position. Producer and consumers walk the same sequence of steps: the
  CTA's j-th tile, K step kk is global step g = j * k_steps + kk, held in
  slot g % stages. Both sides derive g from the same static tile schedule, so
  they agree on every slot without communicating.
- `full[s]` (num_arrivals = 2) guards slot s's data. The producer issues the
  A and B copies of step g with `full[g % stages]`; each TMA copy arrives
  once with its byte count, so the phase completes when both copies have
  landed. Each consumer waits on it before its wgmma reads the slot.
- `empty[s]` (num_arrivals = 2, one per consumer) guards slot s's reuse. A
  consumer arrives on `empty[g % stages]` only when the wgmma that read step
  g has completed: after issuing step g+1's wgmma it waits until at most one
  wgmma is in flight (`wgmma_wait(1)`), which retires step g's, then
  releases step g's slot; the tile's last step is released after
  `wgmma_wait(0)`. The producer waits on `empty[g % stages]` before
  overwriting the slot with step g for every g >= stages (the first
  `stages` steps fill empty slots), and after its last load it waits for the
  last release of every slot it waited on before, so it has observed every
  completion of `empty` when the kernel ends.
- Phase parity. Mosaic GPU flips each barrier's phase bit per wait, so every
  waiter must wait on every completion of a barrier, in order: use u of slot
  s (g = u * stages + s) completes phase u of `full[s]` and of `empty[s]`.
  The consumers wait on `full[s]` for every use and the producer on
  `empty[s]` for uses 1, 2, ... (completion u - 1 before loading use u); a
  skipped or extra wait, or an arrival count that does not match the
  arrivers, desynchronizes the parity (a slot read before it is loaded or
  overwritten before it is consumed). Both consumers run every step of every
  tile, so both barriers see the same arrivals in every phase.
- Epilogue slots. A consumer's TMA stores are bulk groups of its own
  warpgroup. Before writing a piece into out slot e it waits until at most
  one store is in flight (`wait_smem_to_gmem(1, wait_read_only=True)`), so the
  store that last read slot e (two stores ago) is done; before a tile's first
  piece it waits for all (`wait_smem_to_gmem(0, ...)`), so a tile with an odd
  number of pieces cannot reuse a slot under a pending store.
  `commit_smem()` orders its shared-memory writes before the TMA store
  reads them; every consumer waits for all its stores before exiting.

What the CPU interpreter checks of this (docs/perf/mosaic_gpu.md, "Race
detector"; `tests/test_dense_gemm_mosaic.py` breaks the rules it sees):
its race detector, on in every test run, the epilogue rules
(`epilogue_unwaited`, `uncommitted`: only it sees them) and the final
store wait; its barrier checks, the parity (`release_once`); the
products, the ring position (`wrong_slot`). The consumers' ring reads are
wgmma's, which the detector does not order, and wgmma asynchrony
(`wgmma_wait` before a release) is not modelled: those rest on this
argument.
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

from pallas_kernels.dense_gemm.config import DenseGemmSizes, MosaicGemmConfig, tile_coords
from pallas_kernels.shared import mosaic_gpu_compat as compat
from pallas_kernels.shared.common import cdiv, check_nt_operands, resolve_interpret
from pallas_kernels.shared.kernel import Unsupported
from pallas_kernels.shared.mosaic_gpu import (
  CONSUMER_REGISTERS,
  NUM_CONSUMERS,
  PRODUCER_REGISTERS,
  ROW_TRANSFORMS,
  TILE_COLS,
  WGMMA_TRANSFORMS,
  drain_releases,
  num_sms,
  pad_rows,
)

# Test-only sync faults (`_gemm(fault=...)`): each breaks one rule of the
# synchronization argument so a test can show the interpret run catches it
# (the last two only the race detector sees).
FAULTS = ("release_once", "wrong_slot", "epilogue_unwaited", "uncommitted")


# The heuristic's tile: 128x256x64, each consumer 64x256 (wgmma m64n256k16,
# the shape with the fewest shared-memory bytes per MAC), 4 stages
# (192 KiB ring + 32 KiB epilogue).
DEFAULT_CONFIG = MosaicGemmConfig()

# What a sweep explores beside it; each fits the 227 KiB.
_SWEEP_CONFIGS = (
  DEFAULT_CONFIG,
  MosaicGemmConfig(128, 256, 64, stages=4, group_m=16),
  MosaicGemmConfig(128, 256, 64, stages=3, split="n"),
  MosaicGemmConfig(256, 128, 64, stages=3, split="m"),
  MosaicGemmConfig(128, 128, 64, stages=6, split="m"),
  MosaicGemmConfig(128, 256, 128, stages=2, split="m"),
)


def check_problem(m: int, n: int, k: int, config: MosaicGemmConfig) -> None:
  """Raises `Unsupported` unless the kernel handles (M, N, K) with `config`:
  any M, N, K >= 0 with N a multiple of 64 (the width of C's store tiles;
  the last N-tile may be partial) and K of block_k (the recorded shapes
  are)."""
  if min(m, n, k) < 0:
    raise ValueError(f"M, N and K must be >= 0, got {(m, n, k)}")
  if n % TILE_COLS:
    raise Unsupported(f"N={n} must be a multiple of {TILE_COLS} for the Mosaic GPU GEMM")
  if k % config.block_k:
    raise Unsupported(f"K={k} must be a multiple of MosaicGemmConfig.block_k={config.block_k}")


def choose_config(shapes: Mapping[str, Any]) -> MosaicGemmConfig:
  """The heuristic: `DEFAULT_CONFIG`, with block_n 128 where N is a multiple
  of 128 but not of 256 (a narrower tile instead of a half-empty last one).
  At the recorded shapes (N and K multiples of 256, M >= 4096) the default
  gives >= 3.9 tiles per CTA on an H100/H200. Short M keeps it too: a consumer
  cannot own fewer than 64 rows (wgmma's M), and such a product is bound by
  reading B, which the tile shape does not change."""
  _, n, _ = DenseGemmSizes.of(shapes)
  if n % DEFAULT_CONFIG.block_n and n % 128 == 0:
    return dataclasses.replace(DEFAULT_CONFIG, block_n=128)
  return DEFAULT_CONFIG


def candidate_configs(shapes: Mapping[str, Any]) -> list[MosaicGemmConfig]:
  """Configs a sweep may try, the heuristic's first; only those whose
  block_k divides the problem's K."""
  _, _, k = DenseGemmSizes.of(shapes)
  chosen = choose_config(shapes)
  fitting = [c for c in _SWEEP_CONFIGS if k % c.block_k == 0]
  return list(dict.fromkeys([chosen, *fitting]))


def _kernel(a_gmem, b_gmem, c_gmem, *, config: MosaicGemmConfig, m: int, n: int, k: int, grid: int, fault: str | None):
  bm, bn, bk, stages = config.block_m, config.block_n, config.block_k, config.stages
  rows, cols = config.consumer_tile
  num_pid_m, num_pid_n = cdiv(m, bm), cdiv(n, bn)
  num_tiles = num_pid_m * num_pid_n
  k_steps = k // bk
  group_m = min(config.group_m, num_pid_m)
  cta = lax.axis_index("cta")
  # Tiles of this CTA: cta, cta + grid, ... below num_tiles.
  my_tiles = lax.div(num_tiles - 1 - cta, grid) + 1

  def tile_of(j):
    return tile_coords(cta + j * grid, num_pid_m, num_pid_n, group_m)

  def scoped(a_smem, b_smem, out_smem, full, empty):
    wg = lax.axis_index("wg")

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
      plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

      @pl.loop(0, my_tiles)
      def _tile(j):
        tile_m, tile_n = tile_of(j)

        @pl.loop(0, k_steps)
        def _step(kk):
          g = j * k_steps + kk
          slot = lax.rem(g, stages)

          @pl.when(g >= stages)
          def _():
            plgpu.barrier_wait(empty.at[slot])

          ks = pl.ds(kk * bk, bk)
          plgpu.copy_gmem_to_smem(a_gmem.at[pl.ds(tile_m * bm, bm), ks], a_smem.at[slot], full.at[slot])
          plgpu.copy_gmem_to_smem(b_gmem.at[pl.ds(tile_n * bn, bn), ks], b_smem.at[slot], full.at[slot])

      # Observe the last release of every slot waited on above, so that each
      # waiter sees every phase of `empty` (nothing is loaded after it).
      total = my_tiles * k_steps

      drain_releases(total, stages, empty)

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
      plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
      if config.split == "m":
        a_part, b_part = pl.ds(wg * rows, rows), slice(None)
      else:
        a_part, b_part = slice(None), pl.ds(wg * cols, cols)

      def release(g):
        plgpu.barrier_arrive(empty.at[lax.rem(g, stages)])

      @pl.loop(0, my_tiles)
      def _tile(j):
        tile_m, tile_n = tile_of(j)

        def accumulate(acc_ref):
          @pl.loop(0, k_steps)
          def _step(kk):
            g = j * k_steps + kk
            slot = lax.rem(g, stages)
            plgpu.barrier_wait(full.at[slot])
            read = lax.rem(g + 1, stages) if fault == "wrong_slot" else slot
            plgpu.wgmma(acc_ref, a_smem.at[read, a_part], b_smem.at[read, b_part].T)
            # Step g-1's wgmma has retired once at most one is in flight.
            plgpu.wgmma_wait(1)
            pl.when(kk > 0)(lambda: release(g - 1))

          plgpu.wgmma_wait(0)
          release(j * k_steps + k_steps - 1)
          return acc_ref[...]

        acc = pl.run_scoped(accumulate, plgpu.ACC((rows, cols), jnp.float32))  # pyright: ignore[reportPrivateImportUsage] (public Pallas alias)
        c_tile = acc.astype(c_gmem.dtype)
        row0 = tile_m * bm + (wg * rows if config.split == "m" else 0)
        col0 = tile_n * bn + (0 if config.split == "m" else wg * cols)
        # All of the previous tile's stores have read their slots.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        for piece in range(cols // config.epilogue_n):
          out = out_smem.at[wg, piece % 2]
          if fault != "epilogue_unwaited":
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
          out[...] = c_tile[:, piece * config.epilogue_n : (piece + 1) * config.epilogue_n]
          if fault != "uncommitted":
            plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(
            out, c_gmem.at[pl.ds(row0, rows), pl.ds(col0 + piece * config.epilogue_n, config.epilogue_n)]
          )

      plgpu.wait_smem_to_gmem(0)

  pl.run_scoped(
    scoped,
    plgpu.SMEM((stages, bm, bk), a_gmem.dtype, transforms=WGMMA_TRANSFORMS),
    plgpu.SMEM((stages, bn, bk), b_gmem.dtype, transforms=WGMMA_TRANSFORMS),
    plgpu.SMEM((NUM_CONSUMERS, 2, rows, config.epilogue_n), c_gmem.dtype, transforms=ROW_TRANSFORMS),
    plgpu.Barrier(num_arrivals=2, num_barriers=stages),
    plgpu.Barrier(num_arrivals=1 if fault == "release_once" else NUM_CONSUMERS, num_barriers=stages),
    collective_axes="wg",
  )


def grid_size(config: MosaicGemmConfig, m: int, n: int) -> int:
  """The persistent CTA count: `config.grid` (or `num_sms()`), never more
  than the problem's tiles."""
  tiles = cdiv(m, config.block_m) * cdiv(n, config.block_n)
  return max(1, min(config.grid or num_sms(), tiles))


def _gemm(a: jax.Array, b: jax.Array, config: MosaicGemmConfig, interpret: bool, out_dtype, fault: str | None = None):
  """The launch; `fault` (tests only, one of `FAULTS`) breaks the
  synchronization on purpose."""
  if fault is not None and fault not in FAULTS:
    raise ValueError(f"fault must be None or one of {FAULTS}, got {fault!r}")
  (m, k), n = a.shape, b.shape[0]
  check_problem(m, n, k, config)
  if m == 0 or n == 0 or k == 0:
    return jnp.zeros((m, n), out_dtype)
  # An M that is not a multiple of 8 pads A (`pad_rows`); C keeps its M rows.
  a = pad_rows(a, 0)
  grid = grid_size(config, m, n)
  kernel = compat.kernel(
    functools.partial(_kernel, config=config, m=m, n=n, k=k, grid=grid, fault=fault),
    out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
    grid=(grid,),
    grid_names=("cta",),
    num_threads=NUM_CONSUMERS + 1,
    thread_name="wg",
    name=__name__,
    interpret=interpret,
  )
  return kernel(a, b)


# The tensor-core operand and output types this kernel's layouts assume (two
# bytes per element: the 128-byte swizzle holds 64 of them per row).
DTYPES = (jnp.bfloat16, jnp.float16)


@functools.partial(jax.jit, static_argnames=("config", "interpret", "out_dtype"))
def dense_gemm_nt(
  A: jax.Array,
  B: jax.Array,
  *,
  config: MosaicGemmConfig | None = None,
  interpret: bool | None = None,
  out_dtype=jnp.bfloat16,
) -> jax.Array:
  """C = A @ B^T, A [M, K] and B [N, K] of one dtype (bf16 or f16), fp32
  accumulation, C [M, N] rounded once to `out_dtype` (bf16 or f16). Any
  M >= 0; N and K multiples of the config's block_n and block_k; an empty
  product is zeros. Inputs this kernel does not take (another dtype, N or K
  off its tiles) raise `Unsupported`, so `backend="pallas"` falls back.

  `config=None` picks `choose_config`; `interpret=None` interprets (Mosaic
  GPU's CPU interpreter) when no GPU is present. Not differentiable by
  itself: `jaxkern.autodiff` differentiates it through the reference."""
  check_nt_operands(A, B, "A", "B")
  if A.dtype not in DTYPES or jnp.dtype(out_dtype) not in DTYPES:
    raise Unsupported(
      f"A, B and out_dtype must be bfloat16 or float16 for the Mosaic GPU GEMM, "
      f"got {A.dtype} and {jnp.dtype(out_dtype)}"
    )
  if config is None:
    config = choose_config({"A": A, "B": B})
  return _gemm(A, B, config, resolve_interpret(interpret), jnp.dtype(out_dtype))
