"""Dense GEMM on the Pallas Triton lowering: C[M,N] = A[M,K] @ B[N,K]^T, and
its gradients.

A holds activations, B the weight as stored (`[out_features, in_features]`),
so this is `torch.nn.functional.linear` without a bias. Inputs are bf16, the
product accumulates in fp32 and C is rounded to bf16 once at the end.

Each program owns one `block_m x block_n` tile of C and walks K in `block_k`
steps. Programs are numbered along a 1-D grid in "grouped" order: `group_m`
consecutive M-tiles share each N-tile sweep, so the B columns a group reads
stay in L2 while the group's A rows are reused across N (the ordering of
Triton's matmul tutorial). M, N and K need not be multiples of the blocks:
edge tiles are masked, and the K tail is a separate masked step so the main
loop carries no K mask.

One kernel serves every operand layout (`LAYOUTS`, BLAS style): the forward
is "nt"; its custom VJP runs dA = dC . B as "nn" and dB = dC^T . A as "tn",
reading the stored arrays in place (no transposed copy).
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
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.dense_gemm.config import DenseGemmConfig, DenseGemmSizes, tile_coords
from pallas_kernels.shared import common
from pallas_kernels.shared.common import cdiv, check_nt_operands, fit_block, fitted_candidates, resolve_interpret


def _fit(config: DenseGemmConfig, m: int, n: int, k: int) -> DenseGemmConfig:
  return dataclasses.replace(
    config,
    block_m=fit_block(config.block_m, m),
    block_n=fit_block(config.block_n, n),
    block_k=fit_block(config.block_k, k),
  )


# Tile shapes a sweep explores. Shared memory per stage is
# (block_m + block_n) * block_k * 2 bytes; every entry stays under the 227 KiB
# an H100/H200 SM offers at its stage count.
_SWEEP_CONFIGS = (
  DenseGemmConfig(128, 256, 64, 8, num_warps=8, num_stages=3),
  DenseGemmConfig(256, 128, 64, 8, num_warps=8, num_stages=3),
  DenseGemmConfig(128, 128, 64, 8, num_warps=4, num_stages=4),
  DenseGemmConfig(128, 128, 128, 8, num_warps=8, num_stages=3),
  DenseGemmConfig(64, 256, 64, 8, num_warps=4, num_stages=4),
  DenseGemmConfig(64, 128, 64, 8, num_warps=4, num_stages=4),
)


def choose_config(shapes: Mapping[str, Any]) -> DenseGemmConfig:
  """Heuristic tile choice.

  Large problems (all recorded ones: M >= 4096, N >= 4096) use 128x256x64 with
  8 warps and 3 stages, the usual Hopper sweet spot for bf16 on the Triton
  lowering. Short M (decode-like) uses a 64-row tile, clamped down to the
  problem so tiny shapes do not compute mostly padding.
  """
  m, n, k = DenseGemmSizes.of(shapes)
  return _fit(_choose(m), m, n, k)


def _choose(m: int) -> DenseGemmConfig:
  """The tile for M rows (before fitting to the problem)."""
  if m <= 64:
    return DenseGemmConfig(64, 128, 64, 8, num_warps=4, num_stages=4)
  return DenseGemmConfig(128, 256, 64, 8, num_warps=8, num_stages=3)


def candidate_configs(shapes: Mapping[str, Any]) -> list[DenseGemmConfig]:
  """Configs a sweep may try, the heuristic's first."""
  m, n, k = DenseGemmSizes.of(shapes)
  return fitted_candidates(choose_config(shapes), _SWEEP_CONFIGS, lambda c: _fit(c, m, n, k))


# Operand layouts, BLAS style: `layout[0]` is "n" when the left operand X is
# stored [rows, K] and "t" when stored [K, rows]; `layout[1]` is "n" when the
# right operand Y is stored [K, cols] and "t" when stored [cols, K]. The
# forward product A [M,K] . B[N,K]^T is "nt"; its gradients are
# dA = dC . B ("nn") and dB = dC^T . A ("tn").
LAYOUTS = ("nt", "nn", "tn", "tt")


def _k_block(ref, start, block_k: int, k_first: bool, line_ok, k_ok):
  """One K step of an operand: `[lines, block_k]` (stored [lines, K]) or
  `[block_k, lines]` (stored [K, lines], `k_first`); masked where the lines
  (`line_ok`, `[lines]`) or the K tail (`k_ok`, `[block_k]`) run out."""
  k_axis = 0 if k_first else 1
  index = (pl.ds(start, block_k), slice(None)) if k_first else (slice(None), pl.ds(start, block_k))
  masks = []
  if line_ok is not None:
    masks.append(jnp.expand_dims(line_ok, k_axis))
  if k_ok is not None:
    masks.append(jnp.expand_dims(k_ok, 1 - k_axis))
  if not masks:
    return ref[index]
  mask = masks[0] if len(masks) == 1 else masks[0] & masks[1]
  return plgpu.load(ref.at[index], mask=mask, other=0.0)


def _dense_gemm_kernel(
  x_ref,
  y_ref,
  c_ref,
  *,
  layout: str,
  m: int,
  n: int,
  k: int,
  block_m: int,
  block_n: int,
  block_k: int,
  num_pid_m: int,
  num_pid_n: int,
  group_m: int,
):
  # x_ref: the rows of X this tile needs ([block_m, K] or [K, block_m]);
  # y_ref: its columns of Y ([K, block_n] or [block_n, K]); c_ref:
  # [block_m, block_n]. K extents are padded to whole `block_k` steps and
  # edge blocks overhang the arrays; masks keep the overhang out of the sum
  # and out of memory.
  x_k_first, y_k_first = layout[0] == "t", layout[1] == "n"
  dims = (((0 if x_k_first else 1,), (0 if y_k_first else 1,)), ((), ()))
  tile_m, tile_n = tile_coords(pl.program_id(0), num_pid_m, num_pid_n, group_m)
  rows = tile_m * block_m + jnp.arange(block_m, dtype=jnp.int32)
  cols = tile_n * block_n + jnp.arange(block_n, dtype=jnp.int32)
  row_ok = rows < m if m % block_m else None
  col_ok = cols < n if n % block_n else None

  def step(k_block, acc, k_ok=None):
    start = k_block * block_k
    x = _k_block(x_ref, start, block_k, x_k_first, row_ok, k_ok)
    y = _k_block(y_ref, start, block_k, y_k_first, col_ok, k_ok)
    return acc + lax.dot_general(x, y, dims, preferred_element_type=jnp.float32)

  acc = jnp.zeros((block_m, block_n), jnp.float32)
  num_full_k = k // block_k
  acc = lax.fori_loop(0, num_full_k, step, acc)
  if k % block_k:
    # The K tail: zero the columns past K in both operands (a traced start,
    # as every loaded slice is: the masked load handles the overhang).
    k_ok = num_full_k * block_k + jnp.arange(block_k, dtype=jnp.int32) < k
    acc = step(jnp.int32(num_full_k), acc, k_ok)

  c = acc.astype(c_ref.dtype)
  out_mask = None if row_ok is None else row_ok[:, None]
  if col_ok is not None:
    out_mask = col_ok[None, :] if out_mask is None else out_mask & col_ok[None, :]
  if out_mask is None:
    c_ref[...] = c
  else:
    plgpu.store(c_ref, c, mask=out_mask)


def gemm_sizes(x_shape, y_shape, layout: str) -> DenseGemmSizes:
  """(M, N, K) of `op(X) . op(Y)` for stored shapes in `layout`."""
  m, k = x_shape if layout[0] == "n" else x_shape[::-1]
  k_y, n = y_shape if layout[1] == "n" else y_shape[::-1]
  if len(x_shape) != 2 or len(y_shape) != 2 or k != k_y:
    raise ValueError(f"layout {layout!r}: X {tuple(x_shape)} and Y {tuple(y_shape)} do not share K")
  return DenseGemmSizes(int(m), int(n), int(k))


def gemm(
  x: jax.Array,
  y: jax.Array,
  *,
  layout: str = "nt",
  config: DenseGemmConfig | None = None,
  interpret: bool = False,
  out_dtype=jnp.bfloat16,
) -> jax.Array:
  """`C[M,N] = op(X) . op(Y)` in one Pallas launch (`dense_gemm_<layout>`),
  fp32 accumulation, one rounding to `out_dtype`; see `LAYOUTS`. `config`
  None picks `choose_config` for the problem's (M, N, K); a given one is
  fitted to it."""
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  if x.dtype != y.dtype:
    raise ValueError(f"X and Y must share a dtype, got {x.dtype} and {y.dtype}")
  m, n, k = gemm_sizes(x.shape, y.shape, layout)
  if m == 0 or n == 0 or k == 0:
    return jnp.zeros((m, n), out_dtype)
  config = _fit(config or _choose(m), m, n, k)
  num_pid_m, num_pid_n = cdiv(m, config.block_m), cdiv(n, config.block_n)
  group_m = min(config.group_m, num_pid_m)
  # K extents padded to whole steps: no K slice ever overhangs a block (the
  # loads mask the padding), whatever K is.
  k_pad = cdiv(k, config.block_k) * config.block_k

  def tile(pid):
    return tile_coords(pid, num_pid_m, num_pid_n, group_m)

  def operand_spec(lines: int, k_first: bool, which: int):
    if k_first:
      return pl.BlockSpec((k_pad, lines), lambda pid: (0, tile(pid)[which]))
    return pl.BlockSpec((lines, k_pad), lambda pid: (tile(pid)[which], 0))

  kernel = functools.partial(
    _dense_gemm_kernel,
    layout=layout,
    m=m,
    n=n,
    k=k,
    block_m=config.block_m,
    block_n=config.block_n,
    block_k=config.block_k,
    num_pid_m=num_pid_m,
    num_pid_n=num_pid_n,
    group_m=group_m,
  )
  return common.pallas_call(
    kernel,
    out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
    grid=(num_pid_m * num_pid_n,),
    in_specs=[operand_spec(config.block_m, layout[0] == "t", 0), operand_spec(config.block_n, layout[1] == "n", 1)],
    out_specs=pl.BlockSpec((config.block_m, config.block_n), tile),
    compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
    interpret=interpret,
    name=f"dense_gemm_{layout}",
  )(x, y)


def backward_configs(m: int, n: int, k: int) -> tuple[DenseGemmConfig, DenseGemmConfig]:
  """The heuristic's configs of the two gradient GEMMs of an [M,K] x [N,K]
  forward: dA [M,K] (contracting N) and dB [N,K] (contracting M)."""
  return _fit(_choose(m), m, k, n), _fit(_choose(n), n, k, m)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _differentiable_gemm(a, b, config, backward_config, interpret, out_dtype):
  return gemm(a, b, layout="nt", config=config, interpret=interpret, out_dtype=out_dtype)


def _gemm_fwd(a, b, config, backward_config, interpret, out_dtype):
  return _differentiable_gemm(a, b, config, backward_config, interpret, out_dtype), (a, b)


def _gemm_bwd(config, backward_config, interpret, out_dtype, residuals, dc):
  """dA = dC . B and dB = dC^T . A, each one launch of the same kernel in
  another layout (no transpose in HBM); dC is rounded to the operands'
  dtype first, as a mixed-precision backward does."""
  del config, out_dtype
  a, b = residuals
  (m, k), n = a.shape, b.shape[0]
  config_da, config_db = backward_config or backward_configs(m, n, k)
  dc = dc.astype(a.dtype)
  da = gemm(dc, b, layout="nn", config=config_da, interpret=interpret, out_dtype=a.dtype)
  db = gemm(dc, a, layout="tn", config=config_db, interpret=interpret, out_dtype=b.dtype)
  return da, db


_differentiable_gemm.defvjp(_gemm_fwd, _gemm_bwd)


@functools.partial(jax.jit, static_argnames=("config", "backward_config", "interpret", "out_dtype"))
def dense_gemm_nt(
  A: jax.Array,
  B: jax.Array,
  *,
  config: DenseGemmConfig | None = None,
  backward_config: tuple[DenseGemmConfig, DenseGemmConfig] | None = None,
  interpret: bool | None = None,
  out_dtype=jnp.bfloat16,
) -> jax.Array:
  """C = A @ B^T with A [M,K], B [N,K] (one dtype, bf16 in the definitions);
  fp32 accumulation, one rounding to `out_dtype`. Any M, N, K >= 0 (an
  empty product is zeros).

  Differentiable (`jax.custom_vjp`): the gradients are two launches of the
  same kernel, dA = dC . B (`dense_gemm_nn`) and dB = dC^T . A
  (`dense_gemm_tn`), with `backward_config` (dA's config, dB's config) or
  the heuristic's for their shapes (`backward_configs`).

  `config=None` picks `choose_config`; a given config is clamped to the
  problem (blocks never exceed the next power of two of a dimension).
  `interpret=None` interprets when no GPU is present.
  """
  check_nt_operands(A, B, "A", "B")
  return _differentiable_gemm(A, B, config, backward_config, resolve_interpret(interpret), out_dtype)
