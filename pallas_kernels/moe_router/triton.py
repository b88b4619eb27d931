"""DeepSeek-V4 MoE router on the Pallas Triton lowering: router GEMM + top-k.

Math (per token row):
  logits  = hidden @ weight^T                       fp32 accumulation
  scores  = sqrt(softplus(logits))                  "sqrtsoftplus", fp32
  chosen  = top_k(scores + bias), ties to the lower expert id
  weights = scores[chosen] / sum(scores[chosen]) * routed_scaling_factor
Outputs are the chosen ids in ascending order (int32 [M, top_k]) and their
weights permuted alongside (f32 [M, top_k]).

Two kernels, or both in one launch:
* `moe_router_logits` (the GEMM): grid `(E blocks, M blocks, D splits)`;
  a program computes a `[block_m tokens, block_e experts]` fp32 tile over
  its D range and writes it to the partial logits `[splits, M, E]` (real
  tokens and experts only). Splitting E as well as D fills the GPU at
  decode with one pass over the weight: at M = 1, 24 expert blocks x 7 D
  splits = 168 programs (>= an H100/H200's SMs, `DEFAULT_NUM_SMS`), each reading a
  distinct 16 x 768 slice of the weight, with 10.5 KiB of partials against
  the 3.9 MB weight. Large M takes large tiles and no D split: at M = 4096,
  128 x 128 tiles (32 x 3 programs) read the weight once per 128 rows and
  the hidden states once per 128 experts, and the logits (6.3 MB) make the
  one fp32 round trip.
* `moe_router_reduce_route`: sums the splits' partials, several splits per
  (vector) load, and routes a short row tile in registers: E padded to a
  power of two (padded experts never selectable), top-k as k argmax passes
  over a total-order integer key of `scores + bias` (IEEE total order, as
  XLA's top_k, every NaN first made +NaN: NaN above +inf; ties to the
  lowest id, so a row of NaN hidden states selects experts 0..k-1 like the
  XLA path), a second k-pass sweep reading the chosen set back in
  ascending id order.
* `moe_router_one_launch` (`MoeRouterConfig.one_launch`, the decode
  heuristic): the GEMM's grid and programs, each of which then counts
  itself into its row block's arrivals (an int32 per row block, zeroed by
  XLA before the launch); the program that arrives last in its row block
  sums that block's partials and routes its rows as the reduce-and-route
  kernel does, `epilogue.block_m` rows a step. No program waits for
  another. The memory-ordering argument: `_one_launch_kernel`. Splitting E
  alone cannot fill the GPU at decode: a dot needs 16 experts a program
  (E / 16 programs), and dot-free programs of a few experts would each
  read all the hidden states; so the one launch keeps the E x D split of
  the GEMM kernel.
`python -m jaxkern.aot --definition moe_router --all_candidates` checks that
every candidate compiles without spills for sm_90a (register counts:
docs/perf/kernel_notes.md; grids and traffic: docs/perf/moe_kernels.md).
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
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.moe_router.config import MoeRouterConfig, RouterEpilogueStage, RouterGemmStage
from pallas_kernels.shared import common, last_program
from pallas_kernels.shared.common import (
  NT_DIMS,
  cdiv,
  check_nt_operands,
  fit_block,
  fitted_candidates,
  next_pow2,
  resolve_interpret,
)
from pallas_kernels.shared.device import num_sms
from pallas_kernels.shared.fp_formats import f32_bits_one_nan

# The most D splits the heuristic and the sweep use: past this the partials'
# traffic and the reduce kernel's loads grow while the GEMM stage gains little.
_MAX_SPLITS = 16
# GEMM tiles (block_m, block_e) the heuristic tries, largest first: the first
# whose programs fill most of the GPU without a D split wins; failing that,
# the smallest, with D splits.
_TILES = ((128, 128), (64, 128), (64, 64), (32, 64), (32, 32), (16, 32), (16, 16))
# "Most of the GPU": a wave at least this fraction of the SMs (96 programs
# at M = 4096 on an H100/H200: 128 x 128 tiles without partials beat 192 programs
# of 64 x 128 that read the weight twice as often).
_FILL = 0.7
# The most rows of the one-launch form: one row block of the decode tiles
# (16 rows), routed by the GEMM program that finishes last.
_ONE_LAUNCH_MAX_M = 16


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


def _fit(config: MoeRouterConfig, m: int, d: int, e: int) -> MoeRouterConfig:
  """Clamps blocks to the problem (powers of two >= 16 covering M, E, D),
  `split_d` to the D ranges its blocks make, the epilogue's rows to M (and,
  in one launch, to a row block)."""
  gemm = dataclasses.replace(
    config.gemm,
    block_m=fit_block(config.gemm.block_m, m),
    block_e=fit_block(config.gemm.block_e, e),
    block_d=fit_block(config.gemm.block_d, d),
  )
  gemm = dataclasses.replace(gemm, split_d=cdiv(cdiv(d, gemm.block_d), _d_blocks_per_split(gemm, d)))
  rows = min(config.epilogue.block_m, next_pow2(m))
  if config.one_launch:  # a step routes rows of one row block
    rows = min(rows, gemm.block_m)
  return dataclasses.replace(config, gemm=gemm, epilogue=dataclasses.replace(config.epilogue, block_m=rows))


def gemm_programs(gemm: RouterGemmStage, m: int, e: int) -> int:
  """Programs of the GEMM kernel for a fitted stage."""
  return cdiv(m, gemm.block_m) * cdiv(e, gemm.block_e) * gemm.split_d


def _epilogues(m: int) -> list[RouterEpilogueStage]:
  """Epilogue tiles that compile spill-free on sm_90a: 8 rows on 4 warps or
  16 on 8; a tiny M in one tile on 8 or 2 warps (1 row on 4 warps spills,
  oddly)."""
  if m <= 8:
    return [RouterEpilogueStage(next_pow2(m), 8), RouterEpilogueStage(next_pow2(m), 2)]
  return [RouterEpilogueStage(8, 4), RouterEpilogueStage(16, 8)]


def _gemm_stage(m: int, d: int, e: int, sms: int) -> RouterGemmStage:
  """The first of `_TILES` whose programs fill `_FILL` of the SMs without a D
  split (large M: each weight slice read once per 64-128 rows); otherwise
  16 x 16 tiles with the fewest D splits that give every SM a program
  (decode: E and D split, one pass over the weight)."""
  block_d = 128
  for block_m, block_e in _TILES:
    gemm = RouterGemmStage(block_m, block_e, block_d, 1, num_warps=8 if block_m * block_e >= 8192 else 4, num_stages=3)
    if gemm_programs(_fit(MoeRouterConfig(gemm), m, d, e).gemm, m, e) >= _FILL * sms:
      return gemm
  tiles = max(1, cdiv(m, 16) * cdiv(e, 16))  # M = 0: the decode form (the launcher then launches nothing)
  d_blocks = cdiv(d, block_d)
  per_split = max(1, d_blocks // cdiv(sms, tiles))
  return RouterGemmStage(16, 16, block_d, min(_MAX_SPLITS, cdiv(d_blocks, per_split)), num_warps=4, num_stages=3)


def _one_launch(gemm: RouterGemmStage, m: int, warps: int) -> MoeRouterConfig:
  """The one-launch form of a GEMM stage on `warps` warps: route steps of
  up to one row per warp (each [rows, next_pow2(E)] temporary of the
  routing then holds 16 fp32 values a thread at E = 384, spill-free on
  sm_90a with the GEMM's registers)."""
  return MoeRouterConfig(
    dataclasses.replace(gemm, num_warps=warps), RouterEpilogueStage(min(next_pow2(m), warps), warps), one_launch=True
  )


def choose_config(shapes: Mapping[str, Any]) -> MoeRouterConfig:
  """Heuristic: the GEMM tile and D splits from `_gemm_stage` for this GPU's
  SM count. Decode (M <= 16, one row block): one launch, on 4 warps up to 4
  rows and 8 warps above; otherwise two launches, the epilogue tile from M."""
  m, d, e = MoeRouterSizes.of(shapes)
  gemm = _gemm_stage(m, d, e, num_sms())
  if m <= _ONE_LAUNCH_MAX_M:
    return _fit(_one_launch(gemm, m, 4 if m <= 4 else 8), m, d, e)
  return _fit(MoeRouterConfig(gemm, _epilogues(m)[0]), m, d, e)


def candidate_configs(shapes: Mapping[str, Any]) -> list[MoeRouterConfig]:
  """Configs a sweep may try, the heuristic's first: every `_TILES` tile
  with 1, 2, 4 or 8 D splits, and the heuristic's GEMM stage with a 64-column
  D step and with the other epilogue tile; at decode also the one-launch
  form on 4 and 8 warps, with 16-row route steps and with the 64-column D
  step, beside the two-launch forms; all compile without spills on sm_90a
  (`python -m jaxkern.aot --all_candidates`)."""
  m, d, e = MoeRouterSizes.of(shapes)
  chosen = choose_config(shapes)
  epilogues = _epilogues(m)
  two_launch = _fit(MoeRouterConfig(_gemm_stage(m, d, e, num_sms()), epilogues[0]), m, d, e)
  variants = []
  if m <= _ONE_LAUNCH_MAX_M:
    one = [_one_launch(two_launch.gemm, m, warps) for warps in (4, 8)]
    variants += one + [
      dataclasses.replace(one[1], epilogue=RouterEpilogueStage(16, 8)),
      dataclasses.replace(chosen, gemm=dataclasses.replace(chosen.gemm, block_d=64, num_stages=4)),
    ]
  variants += [
    two_launch,
    MoeRouterConfig(dataclasses.replace(two_launch.gemm, block_d=64, num_stages=4), two_launch.epilogue),
  ]
  variants += [MoeRouterConfig(two_launch.gemm, epilogue) for epilogue in epilogues]
  for block_m, block_e in _TILES:
    for split_d in (1, 2, 4, 8):
      gemm = RouterGemmStage(block_m, block_e, 128, split_d, 8 if block_m * block_e >= 8192 else 4, 3)
      variants.append(MoeRouterConfig(gemm, epilogues[0]))
  return fitted_candidates(chosen, variants, lambda c: _fit(c, m, d, e))


def _logits_kernel(
  hidden_ref,
  weight_ref,
  partial_ref,
  *,
  m: int,
  d: int,
  e: int,
  block_m: int,
  block_e: int,
  block_d: int,
  d_blocks_per_split: int,
):
  # Whole-array refs: hidden [M, D], weight [E, D], partial [splits, M, E].
  expert0 = pl.program_id(0) * block_e
  row0 = pl.program_id(1) * block_m
  split = pl.program_id(2)
  first = split * d_blocks_per_split
  count = jnp.minimum(d_blocks_per_split, cdiv(d, block_d) - first)
  rows_ok = (row0 + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)) < m
  experts_ok = (expert0 + lax.broadcasted_iota(jnp.int32, (block_e, 1), 0)) < e

  def load(ref, line0, lines: int, line_ok, col0):
    mask = line_ok & ((col0 + lax.broadcasted_iota(jnp.int32, (1, block_d), 1)) < d)
    return plgpu.load(ref.at[pl.ds(line0, lines), pl.ds(col0, block_d)], mask=mask, other=0.0)

  def step(i, acc):
    col0 = (first + i) * block_d
    x = load(hidden_ref, row0, block_m, rows_ok, col0)
    w = load(weight_ref, expert0, block_e, experts_ok, col0)
    return acc + lax.dot_general(x, w, NT_DIMS, preferred_element_type=jnp.float32)

  tile = lax.fori_loop(0, count, step, jnp.zeros((block_m, block_e), jnp.float32))
  mask = rows_ok & (expert0 + lax.broadcasted_iota(jnp.int32, (1, block_e), 1) < e)
  plgpu.store(partial_ref.at[split, pl.ds(row0, block_m), pl.ds(expert0, block_e)], tile, mask=mask)


def total_order_key(x):
  """fp32 -> int32 keys ordered as IEEE 754's totalOrder (-inf < ... < -0 <
  +0 < ... < +inf < NaN), the order of XLA's top_k, with every NaN first made
  the one +NaN: a NaN's sign is not defined by the arithmetic that made it, so
  it must not decide the ranking. The sign bit flips the magnitude bits of
  negative numbers."""
  bits = f32_bits_one_nan(x)
  return bits ^ ((bits >> 31) & 0x7FFFFFFF)


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
  key = total_order_key(scores + bias)
  lowest_key = jnp.int32(jnp.iinfo(jnp.int32).min)

  # Top-k as k argmax passes; among equal maxima the lowest id wins.
  chosen = jnp.zeros(logits.shape, jnp.bool_)
  for _ in range(top_k):
    available = valid & jnp.logical_not(chosen)
    best = jnp.max(jnp.where(available, key, lowest_key), axis=1)[:, None]
    at_best = available & (key == best)
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
  bias = plgpu.load(bias_ref.at[pl.ds(jnp.int32(0), experts_padded)], mask=experts < e, other=0.0)
  return bias[None, :]


def _store_routes(ids_ref, weights_ref, ids, weights, *, m: int, row_start, ref_row0, top_k: int):
  """Stores rows `row_start..` (masks: rows < m, slots < top_k) at rows
  `ref_row0..` of the refs (a row block's refs: 0; whole arrays: row_start)."""
  rows, top_k_padded = ids.shape
  row_ok = (row_start + lax.broadcasted_iota(jnp.int32, (rows, 1), 0)) < m
  mask = row_ok & (lax.broadcasted_iota(jnp.int32, (1, top_k_padded), 1) < top_k)
  # Traced starts: the padded slot range overhangs the top_k-wide refs.
  at = (pl.ds(ref_row0, rows), pl.ds(jnp.int32(0), top_k_padded))
  plgpu.store(ids_ref.at[at], ids, mask=mask)
  plgpu.store(weights_ref.at[at], weights, mask=mask)


def _splits_per_load(block_m: int, num_warps: int, num_splits: int, experts_padded: int = 512) -> int:
  """Splits the reduce kernel loads at once: as many as keep one load's
  [splits, block_m, experts_padded] fp32 tile at <= 64 registers per thread
  (decode: all 16 splits of its one row in one go, so their loads are in
  flight together instead of one L2 round trip each)."""
  budget = max(1, (64 * 32 * num_warps) // (block_m * experts_padded))
  return min(next_pow2(num_splits), 1 << (budget.bit_length() - 1))


def _reduce_and_route_rows(
  partial_ref,
  bias_ref,
  scale_ref,
  ids_ref,
  weights_ref,
  *,
  row_start,
  ref_row0,
  m,
  e,
  top_k,
  top_k_padded,
  num_splits,
  rows,
  experts_padded,
  splits_per_load,
):
  """Sums the splits' partial logits of `rows` rows (global rows
  `row_start..`, at rows `ref_row0..` of `partial_ref [num_splits, *, E]`
  and of the output refs), routes them and stores their ids and weights."""
  split_ids = lax.broadcasted_iota(jnp.int32, (splits_per_load, 1, 1), 0)
  row_ids = row_start + lax.broadcasted_iota(jnp.int32, (1, rows, 1), 1)
  cols = lax.broadcasted_iota(jnp.int32, (1, 1, experts_padded), 2)
  row_col_ok = (row_ids < m) & (cols < e)

  def add_splits(chunk, acc):
    first = chunk * splits_per_load
    tile = plgpu.load(
      partial_ref.at[pl.ds(first, splits_per_load), pl.ds(ref_row0, rows), pl.ds(jnp.int32(0), experts_padded)],
      mask=row_col_ok & (first + split_ids < num_splits),
      other=0.0,
    )
    return acc + jnp.sum(tile, axis=0)

  logits = lax.fori_loop(
    0, cdiv(num_splits, splits_per_load), add_splits, jnp.zeros((rows, experts_padded), jnp.float32)
  )
  bias = _load_bias(bias_ref, e=e, experts_padded=experts_padded)
  ids, weights = _route(logits, bias, scale_ref[0], e=e, top_k=top_k, top_k_padded=top_k_padded)
  _store_routes(ids_ref, weights_ref, ids, weights, m=m, row_start=row_start, ref_row0=ref_row0, top_k=top_k)


def _reduce_and_route_kernel(partial_ref, bias_ref, scale_ref, ids_ref, weights_ref, *, block_m, routing):
  # partial_ref: [num_splits, block_m, E] fp32 rows of M; ids/weights: [block_m, top_k] blocks.
  _reduce_and_route_rows(
    partial_ref,
    bias_ref,
    scale_ref,
    ids_ref,
    weights_ref,
    row_start=pl.program_id(0) * block_m,
    ref_row0=jnp.int32(0),
    rows=block_m,
    **routing,
  )


def _one_launch_kernel(
  hidden_ref,
  weight_ref,
  bias_ref,
  scale_ref,
  arrivals_in_ref,
  partial_ref,
  arrivals_ref,
  ids_ref,
  weights_ref,
  *,
  tiling,
  routing,
  programs_per_row_block: int,
  route_rows: int,
  interpret: bool,
):
  """The GEMM program of `_logits_kernel`, then, in the last program of its
  row block to finish, the reduce-and-route of that row block's rows,
  `route_rows` at a time (whole-array refs; `arrivals [M blocks]` int32,
  zero at launch; `arrivals_in_ref` is the same buffer, unused).

  The arrival and the memory ordering that makes every program's partial
  tile visible to the last one are `last_program.arrive`'s (its docstring);
  no program waits for another, so the launch needs no co-residency of its
  programs."""
  _logits_kernel(hidden_ref, weight_ref, partial_ref, **tiling)
  row_block = pl.program_id(1)
  arrived = last_program.arrive(arrivals_ref, (row_block,), interpret=interpret)

  @pl.when(arrived == programs_per_row_block - 1)
  def _():
    row0 = row_block * tiling["block_m"]
    rows_here = jnp.minimum(tiling["block_m"], routing["m"] - row0)

    def route_step(i, carry):
      start = row0 + i * route_rows
      _reduce_and_route_rows(
        partial_ref,
        bias_ref,
        scale_ref,
        ids_ref,
        weights_ref,
        row_start=start,
        ref_row0=start,
        rows=route_rows,
        **routing,
      )
      return carry

    lax.fori_loop(0, cdiv(rows_here, route_rows), route_step, jnp.int32(0))


@functools.partial(jax.jit, static_argnames=("top_k", "config", "interpret"))
def moe_router_topk(
  hidden: jax.Array,
  weight: jax.Array,
  bias: jax.Array,
  routed_scaling_factor: jax.Array | float,
  *,
  top_k: int = 6,
  config: MoeRouterConfig | None = None,
  interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
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
  config = _fit(config or choose_config({"hidden": hidden, "weight": weight}), m, d, e)
  interpret = resolve_interpret(interpret)
  gemm = config.gemm
  experts_padded = next_pow2(e)
  top_k_padded = next_pow2(top_k)
  bias = bias.astype(jnp.float32)
  scale = jnp.reshape(jnp.asarray(routed_scaling_factor, jnp.float32), (1,))
  num_splits = gemm.split_d
  tiling = dict(
    m=m,
    d=d,
    e=e,
    block_m=gemm.block_m,
    block_e=gemm.block_e,
    block_d=gemm.block_d,
    d_blocks_per_split=_d_blocks_per_split(gemm, d),
  )
  grid = (cdiv(e, gemm.block_e), cdiv(m, gemm.block_m), num_splits)
  partial_shape = jax.ShapeDtypeStruct((num_splits, m, e), jnp.float32)
  routes_shape = (jax.ShapeDtypeStruct((m, top_k), jnp.int32), jax.ShapeDtypeStruct((m, top_k), jnp.float32))
  routing = dict(
    m=m,
    e=e,
    top_k=top_k,
    top_k_padded=top_k_padded,
    num_splits=num_splits,
    experts_padded=experts_padded,
    splits_per_load=_splits_per_load(config.epilogue.block_m, config.epilogue.num_warps, num_splits, experts_padded),
  )

  def whole(x):
    return pl.BlockSpec(x.shape, lambda *_, nd=x.ndim: (0,) * nd)

  if config.one_launch:
    arrivals = jnp.zeros((grid[1],), jnp.int32)
    _, _, ids, weights = common.pallas_call(
      functools.partial(
        _one_launch_kernel,
        tiling=tiling,
        routing=routing,
        programs_per_row_block=grid[0] * grid[2],
        route_rows=config.epilogue.block_m,
        interpret=interpret,
      ),
      out_shape=(partial_shape, jax.ShapeDtypeStruct(arrivals.shape, jnp.int32), *routes_shape),
      grid=grid,
      in_specs=[whole(hidden), whole(weight), whole(bias), whole(scale), whole(arrivals)],
      out_specs=[whole(partial_shape), whole(arrivals), whole(routes_shape[0]), whole(routes_shape[1])],
      input_output_aliases={4: 1},
      compiler_params=plgpu.CompilerParams(num_warps=gemm.num_warps, num_stages=gemm.num_stages),
      interpret=interpret,
      name="moe_router_one_launch",
    )(hidden, weight, bias, scale, arrivals)
    return ids, weights

  partial = common.pallas_call(
    functools.partial(_logits_kernel, **tiling),
    out_shape=partial_shape,
    grid=grid,
    in_specs=[whole(hidden), whole(weight)],
    out_specs=whole(partial_shape),
    compiler_params=plgpu.CompilerParams(num_warps=gemm.num_warps, num_stages=gemm.num_stages),
    interpret=interpret,
    name="moe_router_logits",
  )(hidden, weight)
  epilogue_block_m = config.epilogue.block_m
  return common.pallas_call(
    functools.partial(_reduce_and_route_kernel, block_m=epilogue_block_m, routing=routing),
    out_shape=routes_shape,
    grid=(cdiv(m, epilogue_block_m),),
    in_specs=[
      pl.BlockSpec((num_splits, epilogue_block_m, e), lambda i: (0, i, 0)),
      pl.BlockSpec((e,), lambda i: (0,)),
      pl.BlockSpec((1,), lambda i: (0,)),
    ],
    out_specs=[pl.BlockSpec((epilogue_block_m, top_k), lambda i: (i, 0))] * 2,
    compiler_params=plgpu.CompilerParams(num_warps=config.epilogue.num_warps, num_stages=1),
    interpret=interpret,
    name="moe_router_reduce_route",
  )(partial, bias, scale)
