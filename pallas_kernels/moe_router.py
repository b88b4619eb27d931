"""DeepSeek-V4 MoE router on the Pallas Triton lowering: router GEMM + top-k.

Math (per token row):
  logits  = hidden @ weight^T                       fp32 accumulation
  scores  = sqrt(softplus(logits))                  "sqrtsoftplus", fp32
  chosen  = top_k(scores + bias), ties to the lower expert id
  weights = scores[chosen] / sum(scores[chosen]) * routed_scaling_factor
Outputs are the chosen ids in ascending order (int32 [M, top_k]) and their
weights permuted alongside (f32 [M, top_k]).

Design. E = 384 experts are held as one 512-wide fp32 row tile per token
(padded experts never selectable), so the routing decision is made in
registers straight from the GEMM accumulator: there is no XLA matmul and no
logits array handed to a separate op. Top-k is k argmax passes over that tile
(lowest id among equal maxima, which gives exact ties to the lower id); a
second k-pass sweep reads the chosen set back in ascending id order, which is
the output order, so no sort is needed. TOPK = 6 is held 8 wide and stored
masked.

Two forms, picked by `MoeRouterConfig.gemm.split_d`:
* `split_d == 1`: one fused kernel; each program owns `block_m` tokens, walks
  all of D, routes, and stores ids/weights. Nothing but the outputs reaches
  HBM. It holds the accumulator and the routing temporaries at once: on
  sm_90a it spills at 64 and at 32 rows, so it is a sweep candidate with
  16-row tiles only and the heuristic never picks it.
* `split_d > 1`: a two-stage design, used for every M. With one program per
  token block, M=1 would stream the whole 3.9 MB weight through one SM and
  M=4096 would use 64 of 132 SMs, each doing 335 MFLOP serially. Splitting D
  over `split_d` programs (at most 16) spreads that work; each program writes
  its fp32 partial logits for real tokens and real experts only
  ([split, M, E]: 1.5 KiB per token and split, 24 KiB at M=1 against the
  3.9 MB weight read), and a small second Pallas kernel sums the partials,
  several splits per (vector) load, and runs the same routing epilogue on a
  short row tile. That is the one HBM round trip of (partial) logits.

`python -m jaxkern.aot --definition moe_router --all_candidates` checks that
every candidate compiles without spills for sm_90a (register counts:
docs/perf/kernel_notes.md).
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

from pallas_kernels.common import NT_DIMS, cdiv, check_nt_operands, fit_block, next_pow2, resolve_interpret
from pallas_kernels.config_rules import (DOT_BLOCK, NUM_STAGES, NUM_WARPS, KernelConfig, at_least, field,
                                         instance_of, pow2)

# Programs that fill an H100/H200 (132 SMs) roughly once; the split heuristic
# aims for this many (token block, D split) programs.
_TARGET_PROGRAMS = 128
# The most D splits the heuristic and the sweep use: past this the partials'
# traffic and the reduce kernel's loads grow while the GEMM stage gains little.
_MAX_SPLITS = 16


@dataclasses.dataclass(frozen=True)
class RouterGemmStage(KernelConfig):
  """The GEMM kernel (fused, or stage 1 of split-D): `block_m` tokens per
  program, `block_d` hidden columns per step, `split_d` requested D splits
  (1 = the fused kernel)."""
  block_m: int = field(64, DOT_BLOCK)
  block_d: int = field(64, DOT_BLOCK)
  split_d: int = field(1, at_least(1))
  num_warps: int = field(8, NUM_WARPS)
  num_stages: int = field(2, NUM_STAGES)


@dataclasses.dataclass(frozen=True)
class RouterEpilogueStage(KernelConfig):
  """The split-D reduce + routing kernel: a short row tile keeps its several
  [rows, 512] fp32/bool temporaries in registers (16 rows need 8 warps to
  stay spill-free on sm_90a, 8 rows fit 4). There is no dot here, so any
  power of two of rows works (decode uses 1 row)."""
  block_m: int = field(16, pow2())
  num_warps: int = field(8, NUM_WARPS)


@dataclasses.dataclass(frozen=True)
class MoeRouterConfig(KernelConfig):
  """Tiling of the router, one part per stage. `gemm.split_d` > 1 selects the
  two-stage split-D form, which also runs `epilogue`."""
  gemm: RouterGemmStage = field(RouterGemmStage(), instance_of(RouterGemmStage))
  epilogue: RouterEpilogueStage = field(RouterEpilogueStage(), instance_of(RouterEpilogueStage))


class MoeRouterSizes(NamedTuple):
  """Problem sizes of the inputs' shapes (input name -> array or ShapeDtypeStruct)."""
  m: int
  d: int
  experts: int

  @classmethod
  def of(cls, shapes: Mapping[str, Any]) -> MoeRouterSizes:
    m, d = shapes["hidden"].shape
    return cls(int(m), int(d), int(shapes["weight"].shape[0]))


def _d_blocks_per_split(gemm: RouterGemmStage, d: int) -> int:
  return cdiv(cdiv(d, gemm.block_d), gemm.split_d)


def _fit(config: MoeRouterConfig, m: int, d: int) -> MoeRouterConfig:
  """Clamps blocks to the problem and `split_d` to the splits it yields; the
  fused form has no epilogue stage (its fields are reset to the defaults so
  equal kernels compare equal)."""
  gemm = dataclasses.replace(config.gemm, block_m=fit_block(config.gemm.block_m, m),
                             block_d=fit_block(config.gemm.block_d, d))
  gemm = dataclasses.replace(gemm, split_d=cdiv(cdiv(d, gemm.block_d), _d_blocks_per_split(gemm, d)))
  if gemm.split_d == 1:
    epilogue = RouterEpilogueStage()
  else:
    epilogue = dataclasses.replace(config.epilogue, block_m=min(config.epilogue.block_m, next_pow2(m)))
  return MoeRouterConfig(gemm=gemm, epilogue=epilogue)


def _epilogues(m: int) -> list[RouterEpilogueStage]:
  """Epilogue tiles that compile spill-free on sm_90a: 8 rows on 4 warps or
  16 on 8; a tiny M in one tile on 8 or 2 warps (1 row on 4 warps spills,
  oddly)."""
  if m <= 8:
    return [RouterEpilogueStage(next_pow2(m), 8), RouterEpilogueStage(next_pow2(m), 2)]
  return [RouterEpilogueStage(8, 4), RouterEpilogueStage(16, 8)]


def choose_config(shapes: Mapping[str, Any]) -> MoeRouterConfig:
  """Heuristic: token tile from M, then enough D splits to fill the GPU.

  The fp32 logit tile is block_m x next_pow2(E); 64 x 512 is the largest that
  keeps the accumulator in registers with 8 warps; every GEMM tile uses 8
  warps (on 4, 32 rows spill and 16 rows come close). Always two stages:
  the fused kernel holds the accumulator and the routing temporaries at
  once and spills at 64 rows on sm_90a. D splits
  aim at `_TARGET_PROGRAMS` programs, at least 2 and at most `_MAX_SPLITS`:
  decode (M <= 16) gets 16 splits of 5 column blocks, whose partials the
  reduce kernel loads in one go.
  """
  m, d, _ = MoeRouterSizes.of(shapes)  # the expert tile is always next_pow2(E) wide
  block_m = 16 if m <= 16 else 32 if m <= 32 else 64
  num_m_blocks = cdiv(m, block_m)
  split_d = 2
  while num_m_blocks * split_d * 2 <= _TARGET_PROGRAMS and split_d < _MAX_SPLITS:
    split_d *= 2
  gemm = RouterGemmStage(block_m=block_m, block_d=64, split_d=split_d, num_warps=8, num_stages=2)
  return _fit(MoeRouterConfig(gemm=gemm, epilogue=_epilogues(m)[0]), m, d)


def candidate_configs(shapes: Mapping[str, Any]) -> list[MoeRouterConfig]:
  """Configs a sweep may try, the heuristic's first. Only forms that compile
  without spills on sm_90a (checked with `python -m jaxkern.aot
  --all_candidates` at M = 1, 3, 128, 4096 and 8192): GEMM tiles on 8
  warps, the fused form only with 16-row tiles, at most `_MAX_SPLITS` splits."""
  m, d, _ = MoeRouterSizes.of(shapes)
  out = [choose_config(shapes)]
  for block_m in (16, 32, 64):
    for block_d, num_stages in ((64, 2), (32, 3)):
      for split_d in (1, 2, 4, 8, _MAX_SPLITS):
        if split_d == 1 and block_m > 16:
          continue  # fused with 32+ rows: the accumulator and routing spill
        gemm = RouterGemmStage(block_m, block_d, split_d, 8, num_stages)
        for epilogue in _epilogues(m):
          config = _fit(MoeRouterConfig(gemm, epilogue), m, d)
          if config not in out:
            out.append(config)
  return out


def _accumulate_logits(hidden_ref, weight_ref, first_d_block, num_d_blocks, *,
                       m: int, d: int, e: int, block_m: int, block_d: int,
                       experts_padded: int, row_start):
  """fp32 [block_m, experts_padded] = hidden rows @ weight^T over a D range."""
  rows = row_start + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
  experts = lax.broadcasted_iota(jnp.int32, (experts_padded, 1), 0)
  row_ok = rows < m if m % block_m else None
  expert_ok = experts < e if e != experts_padded else None

  def load(ref, start, lines: int, line_ok):
    mask = line_ok
    if d % block_d:  # D tail: zero the columns past D.
      col_ok = (start + lax.broadcasted_iota(jnp.int32, (1, block_d), 1)) < d
      mask = col_ok if mask is None else mask & col_ok
    if mask is None:
      return ref[pl.ds(0, lines), pl.ds(start, block_d)]
    # A traced row start: the padded expert tile overhangs the weight ref,
    # which a static slice rejects at trace time; the mask covers it.
    return plgpu.load(ref.at[pl.ds(jnp.int32(0), lines), pl.ds(start, block_d)],
                      mask=mask, other=0.0)

  def step(i, acc):
    start = (first_d_block + i) * block_d
    x = load(hidden_ref, start, block_m, row_ok)
    w = load(weight_ref, start, experts_padded, expert_ok)
    return acc + lax.dot_general(x, w, NT_DIMS, preferred_element_type=jnp.float32)

  acc = jnp.zeros((block_m, experts_padded), jnp.float32)
  return lax.fori_loop(0, num_d_blocks, step, acc)


def _route(logits, bias, scale, *, e: int, top_k: int, top_k_padded: int):
  """Routing epilogue on an fp32 [rows, experts_padded] logit tile.

  Returns ids int32 [rows, top_k_padded] ascending and their weights f32;
  columns >= top_k are filler the caller masks out on store.
  """
  experts_padded = logits.shape[1]
  expert_ids = lax.broadcasted_iota(jnp.int32, (1, experts_padded), 1)
  valid = expert_ids < e
  # Stable softplus: max(x, 0) + log1p(exp(-|x|)) never overflows.
  softplus = jnp.maximum(logits, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(logits)))
  scores = jnp.sqrt(softplus)
  ranking = scores + bias
  neg_inf = jnp.float32(-jnp.inf)

  # Top-k as k argmax passes; among equal maxima the lowest id wins.
  chosen = jnp.zeros(logits.shape, jnp.bool_)
  for _ in range(top_k):
    available = valid & jnp.logical_not(chosen)
    best = jnp.max(jnp.where(available, ranking, neg_inf), axis=1)[:, None]
    at_best = available & (ranking == best)
    pick = jnp.min(jnp.where(at_best, expert_ids, experts_padded), axis=1)[:, None]
    chosen = chosen | (expert_ids == pick)

  total = jnp.sum(jnp.where(chosen, scores, 0.0), axis=1)[:, None]
  # Read the chosen set back in ascending id order (the output order).
  slots = lax.broadcasted_iota(jnp.int32, (1, top_k_padded), 1)
  ids = jnp.zeros((logits.shape[0], top_k_padded), jnp.int32)
  weights = jnp.zeros((logits.shape[0], top_k_padded), jnp.float32)
  remaining = chosen
  for slot in range(top_k):
    lowest = jnp.min(jnp.where(remaining, expert_ids, experts_padded), axis=1)[:, None]
    hit = expert_ids == lowest
    score = jnp.sum(jnp.where(hit, scores, 0.0), axis=1)[:, None]
    remaining = remaining & jnp.logical_not(hit)
    ids = jnp.where(slots == slot, lowest, ids)
    weights = jnp.where(slots == slot, score / total * scale, weights)
  return ids, weights


def _load_bias(bias_ref, *, e: int, experts_padded: int):
  experts = lax.broadcasted_iota(jnp.int32, (experts_padded,), 0)
  bias = plgpu.load(bias_ref.at[pl.ds(jnp.int32(0), experts_padded)],
                    mask=experts < e, other=0.0)
  return bias[None, :]


def _store_routes(ids_ref, weights_ref, ids, weights, *, m: int, row_start,
                  top_k: int):
  rows, top_k_padded = ids.shape
  row_ok = (row_start + lax.broadcasted_iota(jnp.int32, (rows, 1), 0)) < m
  mask = row_ok & (lax.broadcasted_iota(jnp.int32, (1, top_k_padded), 1) < top_k)
  # Traced start: the padded slot range overhangs the top_k-wide refs.
  cols = pl.ds(jnp.int32(0), top_k_padded)
  plgpu.store(ids_ref.at[:, cols], ids, mask=mask)
  plgpu.store(weights_ref.at[:, cols], weights, mask=mask)


def _fused_router_kernel(hidden_ref, weight_ref, bias_ref, scale_ref,
                         ids_ref, weights_ref, *, m, d, e, top_k, block_m,
                         block_d, experts_padded, top_k_padded):
  row_start = pl.program_id(0) * block_m
  logits = _accumulate_logits(
      hidden_ref, weight_ref, 0, cdiv(d, block_d), m=m, d=d, e=e,
      block_m=block_m, block_d=block_d, experts_padded=experts_padded,
      row_start=row_start)
  bias = _load_bias(bias_ref, e=e, experts_padded=experts_padded)
  ids, weights = _route(logits, bias, scale_ref[0], e=e, top_k=top_k,
                        top_k_padded=top_k_padded)
  _store_routes(ids_ref, weights_ref, ids, weights, m=m, row_start=row_start,
                top_k=top_k)


def _partial_logits_kernel(hidden_ref, weight_ref, partial_ref, *, m, d, e,
                           block_m, block_d, experts_padded, d_blocks_per_split):
  split = pl.program_id(1)
  first = split * d_blocks_per_split
  count = jnp.minimum(d_blocks_per_split, cdiv(d, block_d) - first)
  row_start = pl.program_id(0) * block_m
  partial = _accumulate_logits(
      hidden_ref, weight_ref, first, count, m=m, d=d, e=e, block_m=block_m,
      block_d=block_d, experts_padded=experts_padded, row_start=row_start)
  # Only real tokens and real experts are written: [split, M, E], so decode
  # (M=1 in a 16-row tile) writes 1.5 KiB per split, not 32 KiB.
  mask = None
  if m % block_m:
    mask = (row_start + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)) < m
  if e != experts_padded:
    col_ok = lax.broadcasted_iota(jnp.int32, (1, experts_padded), 1) < e
    mask = col_ok if mask is None else mask & col_ok
  if mask is None:
    partial_ref[...] = partial
  else:
    # Traced start: the padded expert tile overhangs the E-wide ref.
    plgpu.store(partial_ref.at[:, pl.ds(jnp.int32(0), experts_padded)], partial, mask=mask)


def _splits_per_load(block_m: int, num_warps: int, num_splits: int, experts_padded: int = 512) -> int:
  """Splits the reduce kernel loads at once: as many as keep one load's
  [splits, block_m, experts_padded] fp32 tile at <= 64 registers per thread
  (decode: all 16 splits of its one row in one go, so their loads are in
  flight together instead of one L2 round trip each)."""
  budget = max(1, (64 * 32 * num_warps) // (block_m * experts_padded))
  return min(next_pow2(num_splits), 1 << (budget.bit_length() - 1))


def _reduce_and_route_kernel(partial_ref, bias_ref, scale_ref, ids_ref,
                             weights_ref, *, m, e, top_k, top_k_padded,
                             num_splits, block_m, experts_padded, splits_per_load):
  # partial_ref: [num_splits, block_m, E] fp32 rows of M.
  row_start = pl.program_id(0) * block_m
  split_ids = lax.broadcasted_iota(jnp.int32, (splits_per_load, 1, 1), 0)
  rows = row_start + lax.broadcasted_iota(jnp.int32, (1, block_m, 1), 1)
  cols = lax.broadcasted_iota(jnp.int32, (1, 1, experts_padded), 2)
  row_col_ok = (rows < m) & (cols < e)

  def add_splits(chunk, acc):
    first = chunk * splits_per_load
    tile = plgpu.load(
        partial_ref.at[pl.ds(first, splits_per_load), :, pl.ds(jnp.int32(0), experts_padded)],
        mask=row_col_ok & (first + split_ids < num_splits), other=0.0)
    return acc + jnp.sum(tile, axis=0)

  logits = lax.fori_loop(0, cdiv(num_splits, splits_per_load), add_splits,
                         jnp.zeros((block_m, experts_padded), jnp.float32))
  bias = _load_bias(bias_ref, e=e, experts_padded=experts_padded)
  ids, weights = _route(logits, bias, scale_ref[0], e=e, top_k=top_k,
                        top_k_padded=top_k_padded)
  _store_routes(ids_ref, weights_ref, ids, weights, m=m, row_start=row_start,
                top_k=top_k)


@functools.partial(jax.jit, static_argnames=("top_k", "config", "interpret"))
def moe_router_topk(hidden: jax.Array, weight: jax.Array, bias: jax.Array,
                    routed_scaling_factor: jax.Array | float, *, top_k: int = 6,
                    config: MoeRouterConfig | None = None,
                    interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """Router GEMM + sqrtsoftplus + biased top-k in Pallas.

  hidden [M,D] and weight [E,D] share a dtype (bf16); bias [E] f32;
  routed_scaling_factor a scalar (traced, not static). Returns
  (expert_ids int32 [M,top_k] ascending, expert_weights f32 [M,top_k]).
  """
  check_nt_operands(hidden, weight, "hidden", "weight")
  m, d = hidden.shape
  e = weight.shape[0]
  if bias.shape != (e,):
    raise ValueError(f"bias must be [{e}], got {bias.shape}")
  if not 1 <= top_k <= e:
    raise ValueError(f"top_k={top_k} must be in [1, {e}]")
  if m == 0:
    return jnp.zeros((0, top_k), jnp.int32), jnp.zeros((0, top_k), jnp.float32)
  config = _fit(config or choose_config({"hidden": hidden, "weight": weight}), m, d)
  interpret = resolve_interpret(interpret)
  gemm = config.gemm
  block_m = gemm.block_m
  num_m_blocks = cdiv(m, block_m)
  experts_padded = next_pow2(e)
  top_k_padded = next_pow2(top_k)
  bias = bias.astype(jnp.float32)
  scale = jnp.reshape(jnp.asarray(routed_scaling_factor, jnp.float32), (1,))
  out_shape = (jax.ShapeDtypeStruct((m, top_k), jnp.int32),
               jax.ShapeDtypeStruct((m, top_k), jnp.float32))
  dims = dict(m=m, d=d, e=e, block_m=block_m, block_d=gemm.block_d,
              experts_padded=experts_padded)

  if gemm.split_d == 1:
    return common.pallas_call(
        functools.partial(_fused_router_kernel, top_k=top_k,
                          top_k_padded=top_k_padded, **dims),
        out_shape=out_shape,
        grid=(num_m_blocks,),
        in_specs=[
            pl.BlockSpec((block_m, d), lambda i: (i, 0)),
            pl.BlockSpec((e, d), lambda i: (0, 0)),
            pl.BlockSpec((e,), lambda i: (0,)),
            pl.BlockSpec((1,), lambda i: (0,)),
        ],
        out_specs=[pl.BlockSpec((block_m, top_k), lambda i: (i, 0))] * 2,
        compiler_params=plgpu.CompilerParams(
            num_warps=gemm.num_warps, num_stages=gemm.num_stages),
        interpret=interpret,
        name="moe_router_fused",
    )(hidden, weight, bias, scale)

  num_splits = gemm.split_d
  partial = common.pallas_call(
      functools.partial(_partial_logits_kernel,
                        d_blocks_per_split=_d_blocks_per_split(gemm, d), **dims),
      out_shape=jax.ShapeDtypeStruct((num_splits, m, e), jnp.float32),
      grid=(num_m_blocks, num_splits),
      in_specs=[
          pl.BlockSpec((block_m, d), lambda i, s: (i, 0)),
          pl.BlockSpec((e, d), lambda i, s: (0, 0)),
      ],
      out_specs=pl.BlockSpec((None, block_m, e), lambda i, s: (s, i, 0)),
      compiler_params=plgpu.CompilerParams(
          num_warps=gemm.num_warps, num_stages=gemm.num_stages),
      interpret=interpret,
      name="moe_router_partial_logits",
  )(hidden, weight)
  epilogue_block_m = config.epilogue.block_m
  splits_per_load = _splits_per_load(epilogue_block_m, config.epilogue.num_warps, num_splits,
                                     experts_padded)
  return common.pallas_call(
      functools.partial(_reduce_and_route_kernel, m=m, e=e, top_k=top_k,
                        top_k_padded=top_k_padded, num_splits=num_splits,
                        block_m=epilogue_block_m, experts_padded=experts_padded,
                        splits_per_load=splits_per_load),
      out_shape=out_shape,
      grid=(cdiv(m, epilogue_block_m),),
      in_specs=[
          pl.BlockSpec((num_splits, epilogue_block_m, e), lambda i: (0, i, 0)),
          pl.BlockSpec((e,), lambda i: (0,)),
          pl.BlockSpec((1,), lambda i: (0,)),
      ],
      out_specs=[pl.BlockSpec((epilogue_block_m, top_k), lambda i: (i, 0))] * 2,
      compiler_params=plgpu.CompilerParams(
          num_warps=config.epilogue.num_warps, num_stages=1),
      interpret=interpret,
      name="moe_router_reduce_route",
  )(partial, bias, scale)

