"""Dense NT GEMM on the Pallas Triton lowering: C[M,N] = A[M,K] @ B[N,K]^T.

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
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, NamedTuple

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from pallas_kernels import common
import jax.numpy as jnp

from pallas_kernels.common import NT_DIMS, cdiv, check_nt_operands, fit_block, fitted_candidates, resolve_interpret
from pallas_kernels.config_rules import DOT_BLOCK, NUM_STAGES, NUM_WARPS, KernelConfig, at_least, field


@dataclasses.dataclass(frozen=True)
class DenseGemmConfig(KernelConfig):
  """Tiling of the NT GEMM; `group_m` M-tiles per group in the grouped
  program order."""
  block_m: int = field(128, DOT_BLOCK)
  block_n: int = field(256, DOT_BLOCK)
  block_k: int = field(64, DOT_BLOCK)
  group_m: int = field(8, at_least(1))
  num_warps: int = field(8, NUM_WARPS)
  num_stages: int = field(3, NUM_STAGES)


class DenseGemmSizes(NamedTuple):
  """Problem sizes of the inputs' shapes (input name -> array or ShapeDtypeStruct)."""
  m: int
  n: int
  k: int

  @classmethod
  def of(cls, shapes: Mapping[str, Any]) -> DenseGemmSizes:
    m, k = shapes["A"].shape
    return cls(int(m), int(shapes["B"].shape[0]), int(k))


def _fit(config: DenseGemmConfig, m: int, n: int, k: int) -> DenseGemmConfig:
  return dataclasses.replace(
      config,
      block_m=fit_block(config.block_m, m),
      block_n=fit_block(config.block_n, n),
      block_k=fit_block(config.block_k, k))


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
  if m <= 64:
    base = DenseGemmConfig(64, 128, 64, 8, num_warps=4, num_stages=4)
  else:
    base = DenseGemmConfig(128, 256, 64, 8, num_warps=8, num_stages=3)
  return _fit(base, m, n, k)


def candidate_configs(shapes: Mapping[str, Any]) -> list[DenseGemmConfig]:
  """Configs a sweep may try, the heuristic's first."""
  m, n, k = DenseGemmSizes.of(shapes)
  return fitted_candidates(choose_config(shapes), _SWEEP_CONFIGS, lambda c: _fit(c, m, n, k))


def _tile_coords(pid, num_pid_m: int, num_pid_n: int, group_m: int):
  """Maps the 1-D program id to (tile_m, tile_n) in grouped order.

  Programs walk `group_m` M-tiles down one N column before moving right, so
  concurrently running programs share B tiles (and A tiles across columns).
  """
  programs_per_group = group_m * num_pid_n
  group = lax.div(pid, programs_per_group)
  first_m = group * group_m
  group_rows = jnp.minimum(num_pid_m - first_m, group_m)
  within = lax.rem(pid, programs_per_group)
  return first_m + lax.rem(within, group_rows), lax.div(within, group_rows)


def _dense_gemm_nt_kernel(a_ref, b_ref, c_ref, *, m: int, n: int, k: int,
                          block_m: int, block_n: int, block_k: int,
                          num_pid_m: int, num_pid_n: int, group_m: int):
  # a_ref: [block_m, K] rows of A; b_ref: [block_n, K] rows of B; c_ref:
  # [block_m, block_n]. Edge blocks overhang the arrays; masks keep the
  # overhang out of the sum and out of memory.
  tile_m, tile_n = _tile_coords(pl.program_id(0), num_pid_m, num_pid_n, group_m)
  # Row masks of the A tile ([block_m, 1]) and of the B tile ([block_n, 1]).
  rows = tile_m * block_m + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
  cols = tile_n * block_n + lax.broadcasted_iota(jnp.int32, (block_n, 1), 0)
  row_ok = rows < m if m % block_m else None
  col_ok = cols < n if n % block_n else None

  def load(ref, start, line_ok, k_ok):
    mask = line_ok
    if k_ok is not None:
      mask = k_ok if mask is None else mask & k_ok
    if mask is None:
      return ref[:, pl.ds(start, block_k)]
    return plgpu.load(ref.at[:, pl.ds(start, block_k)], mask=mask, other=0.0)

  def step(k_block, acc, k_ok=None):
    start = k_block * block_k
    a = load(a_ref, start, row_ok, k_ok)
    b = load(b_ref, start, col_ok, k_ok)
    return acc + lax.dot_general(a, b, NT_DIMS, preferred_element_type=jnp.float32)

  acc = jnp.zeros((block_m, block_n), jnp.float32)
  num_full_k = k // block_k
  acc = lax.fori_loop(0, num_full_k, step, acc)
  if k % block_k:
    # The K tail: zero the columns past K in both operands.
    k_ok = (num_full_k * block_k
            + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)) < k
    # A traced start: a static slice that overhangs the ref is rejected at
    # trace time, while the masked load itself handles the overhang.
    acc = step(jnp.int32(num_full_k), acc, k_ok)

  c = acc.astype(c_ref.dtype)
  out_mask = row_ok
  if n % block_n:  # C columns run along the tile's second axis.
    out_col_ok = (tile_n * block_n
                  + lax.broadcasted_iota(jnp.int32, (1, block_n), 1)) < n
    out_mask = out_col_ok if out_mask is None else out_mask & out_col_ok
  if out_mask is None:
    c_ref[...] = c
  else:
    plgpu.store(c_ref, c, mask=out_mask)


@functools.partial(jax.jit, static_argnames=("config", "interpret", "out_dtype"))
def dense_gemm_nt(A: jax.Array, B: jax.Array, *,  # pylint: disable=invalid-name

                  config: DenseGemmConfig | None = None,
                  interpret: bool | None = None,
                  out_dtype=jnp.bfloat16) -> jax.Array:
  """C = A @ B^T with A [M,K], B [N,K] (both bf16); fp32 accumulation.

  `config=None` picks `choose_config`; a given config is clamped to
  the problem (blocks never exceed the next power of two of a dimension).
  `interpret=None` interprets when no GPU is present.
  """
  a, b = A, B
  check_nt_operands(a, b, "A", "B")
  m, k = a.shape
  n = b.shape[0]
  if m == 0 or n == 0:
    return jnp.zeros((m, n), out_dtype)
  config = _fit(config or choose_config({"A": a, "B": b}), m, n, k)
  num_pid_m = cdiv(m, config.block_m)
  num_pid_n = cdiv(n, config.block_n)
  group_m = min(config.group_m, num_pid_m)

  def tile(pid):
    return _tile_coords(pid, num_pid_m, num_pid_n, group_m)

  kernel = functools.partial(
      _dense_gemm_nt_kernel, m=m, n=n, k=k, block_m=config.block_m,
      block_n=config.block_n, block_k=config.block_k, num_pid_m=num_pid_m,
      num_pid_n=num_pid_n, group_m=group_m)
  return common.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid=(num_pid_m * num_pid_n,),
      in_specs=[
          pl.BlockSpec((config.block_m, k), lambda pid: (tile(pid)[0], 0)),
          pl.BlockSpec((config.block_n, k), lambda pid: (tile(pid)[1], 0)),
      ],
      out_specs=pl.BlockSpec((config.block_m, config.block_n), tile),
      compiler_params=plgpu.CompilerParams(
          num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=resolve_interpret(interpret),
      name="dense_gemm_nt",
  )(a, b)
