"""What Mosaic GPU's Pallas API lets a Hopper kernel do with rows gathered by
index (the sparse MLA prefill's access pattern): each case is a tiny
`plgpu.kernel`, run in the CPU interpreter and lowered for an abstract H100.
Prints one line per case and mode: `ok` or the first line of the error.

    JAX_PLATFORMS=cpu PYTHONPATH=$PWD .venv/bin/python docs/perf/probes/mosaic_gpu_gather.py

The findings are in docs/perf/mosaic_gpu.md ("Sparse MLA prefill: gathering
rows on Hopper").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.shared import mosaic_gpu_compat as compat
from pallas_kernels.shared.lowering import lower_for_h100
from pallas_kernels.shared.mosaic_gpu import WGMMA_TRANSFORMS

ROWS, WIDTH, HALF = 64, 512, 256  # one gathered step of latent rows; TMA boxes hold <= 256 per dim
BF16 = jnp.bfloat16


def _gather_kernel(tiled_ring: bool, relayout: bool):
  """Gathers ROWS rows `kv[idx[r]]` with one TMA per row (per 256-column
  half) into a ring slot, either straight into a wgmma-tiled slot or into an
  untiled staging buffer that the warpgroup then copies into a tiled slot
  through registers (WGMMA layout, 64 x 64 chunks); stores the slot."""

  def kernel(kv_gmem, idx_gmem, o_gmem):
    def scoped(stage, ring, idx_smem, rows_landed, idx_landed):
      plgpu.copy_gmem_to_smem(idx_gmem, idx_smem, idx_landed)
      plgpu.barrier_wait(idx_landed)
      target = ring if tiled_ring else stage

      @pl.loop(0, ROWS)
      def _(r):
        row = idx_smem[r]
        for h in range(WIDTH // HALF):
          cols = pl.ds(h * HALF, HALF)
          plgpu.copy_gmem_to_smem(kv_gmem.at[pl.ds(row, 1), cols], target.at[pl.ds(r, 1), cols], rows_landed)

      plgpu.barrier_wait(rows_landed)
      if relayout:
        for c in range(WIDTH // 64):
          cols = pl.ds(64 * c, 64)
          chunk = plgpu.load(stage.at[:, cols], layout=plgpu.Layout.WGMMA, optimized=False)
          ring[:, cols] = plgpu.layout_cast(chunk, plgpu.Layout.WGMMA)
        plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(ring if (tiled_ring or relayout) else stage, o_gmem)
      plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
      scoped,
      plgpu.SMEM((ROWS, WIDTH), BF16),
      plgpu.SMEM((ROWS, WIDTH), BF16, transforms=WGMMA_TRANSFORMS),
      plgpu.SMEM((ROWS,), jnp.int32),
      plgpu.Barrier(num_arrivals=ROWS * WIDTH // HALF),
      plgpu.Barrier(num_arrivals=1),
    )

  return kernel


def _accumulate_in_place_kernel(a_gmem, b_gmem, o_gmem):
  """Three `acc = acc * 0.5 + a @ b` steps on one wgmma accumulator ref,
  rescaled in place (what a 64 x 256 fp32 output half needs to stay at 128
  registers a thread)."""

  def scoped(a_smem, b_smem, o_smem, landed):
    plgpu.copy_gmem_to_smem(a_gmem, a_smem, landed)
    plgpu.copy_gmem_to_smem(b_gmem, b_smem, landed)
    plgpu.barrier_wait(landed)

    def steps(acc_ref):
      @pl.loop(0, 3)
      def _(g):
        acc_ref[...] = acc_ref[...] * 0.5
        plgpu.wgmma(acc_ref, a_smem, b_smem)

      return acc_ref[...]

    o_smem[...] = pl.run_scoped(steps, plgpu.ACC((64, HALF), jnp.float32)).astype(BF16)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem)
    plgpu.wait_smem_to_gmem(0)

  pl.run_scoped(
    scoped,
    plgpu.SMEM((64, 64), BF16, transforms=WGMMA_TRANSFORMS),
    plgpu.SMEM((64, HALF), BF16, transforms=WGMMA_TRANSFORMS),
    plgpu.SMEM((64, HALF), BF16, transforms=WGMMA_TRANSFORMS),
    plgpu.Barrier(num_arrivals=2),
  )


def _run(kernel, out_shape, args, expected, interpret: bool) -> str:
  call = compat.kernel(kernel, name=__name__, interpret=interpret, out_type=jax.ShapeDtypeStruct(out_shape, BF16))
  try:
    if interpret:
      out = np.asarray(call(*args).astype(jnp.float32))
      return "ok" if np.allclose(out, expected, rtol=2e-2, atol=2e-2) else "wrong result"
    lower_for_h100(call, *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args))
    return "ok"
  except Exception as error:  # noqa: BLE001 - the probe reports what failed
    compat.reset_interpreter()
    return f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"


def main() -> None:
  kv = jax.random.normal(jax.random.key(0), (1000, WIDTH), BF16)
  idx = jnp.asarray(np.random.default_rng(0).integers(0, 1000, ROWS), jnp.int32)
  gathered = np.asarray(kv[idx].astype(jnp.float32))
  a = jax.random.normal(jax.random.key(1), (64, 64), BF16)
  b = jax.random.normal(jax.random.key(2), (64, HALF), BF16)
  product = np.asarray(a.astype(jnp.float32) @ b.astype(jnp.float32))
  cases = {
    "1-row TMA into a wgmma-tiled slot": (_gather_kernel(True, False), (ROWS, WIDTH), (kv, idx), gathered),
    "1-row TMA into untiled staging": (_gather_kernel(False, False), (ROWS, WIDTH), (kv, idx), gathered),
    "staging -> tiled slot via WGMMA-layout registers": (
      _gather_kernel(False, True),
      (ROWS, WIDTH),
      (kv, idx),
      gathered,
    ),
    "in-place rescale of a wgmma accumulator": (
      _accumulate_in_place_kernel,
      (64, HALF),
      (a, b),
      product * (0.25 + 0.5 + 1.0),
    ),
  }
  print(f"jax {jax.__version__}")
  for name, (kernel, shape, args, expected) in cases.items():
    for mode, interpret in (("interpret", True), ("H100 lowering", False)):
      print(f"{name} | {mode} | {_run(kernel, shape, args, expected, interpret)}")


if __name__ == "__main__":
  main()
