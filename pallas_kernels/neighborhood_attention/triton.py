"""3-D neighborhood attention (NATTEN semantics) on the Pallas Triton lowering.

Semantics (stride 1, dilation 1, non-causal): along each axis of length `L`
with window `k`, query index `i` attends to keys `[s, s + k)` with
`s = clamp(i - k // 2, 0, L - k)`: windows shift inward at the borders and
are never padded, so every query sees exactly `KT * KY * KX` keys. The
softmax runs over the Cartesian product of the three windows. `q` arrives
already scaled: no `D**-0.5` is applied.

One kernel serves every window: `(KT, KY, KX)` are static parameters.

Layout `[B, T, Y, X, H, D]`, viewed (free reshape) as `[B, N, H, D]` with
`N = T * Y * X`; a program reads rows of one (batch row, head) by flat index.

Grid `(query tiles, B, H)`, the tile index fastest so that neighbouring tiles
run together and share their key halos in L2. A program:

1. owns a query tile of `block_t x block_y x block_x` grid points (a power of
   two `Q` in all, at least 16), gathered into a `[Q, D]` operand by row
   index (coordinates past the grid are clamped for the address; those rows
   are computed, but not stored);
2. computes each query's window starts and the key box that covers the union
   of the tile's windows (the halo): it starts at the first query's window
   start on each axis and spans `block + k - 1` (every later window start is
   at most `block - 1` further, since `s` grows by at most 1 per index);
3. walks the halo box, flattened in (t, y, x) order, in chunks of `block_k`
   keys (no per-row padding: only the last chunk is partial). Each chunk is
   gathered by row index into `[block_k, D]` K and V operands (rows from
   the halo's static slot table, `tiles.halo_slots`), scored with one
   `[Q, D] x [D, block_k]` dot in fp32, masked with the per-(query, key)
   window test `0 <= key - start(query) < k` on each axis (from the slot
   table's window bits: it also hides the rows past the grid and the padding
   of the last chunk, which lie outside every window), and folded into the
   online softmax (`online_softmax`: FlashAttention-2, base 2, fp32, the
   `log2 e` scale fused into the exponent's fma, the running max started
   finite); the probabilities are rounded to the value dtype for the second
   dot, as every flash kernel does, and their row sums come from a third,
   narrow dot with ones (the denominator sums the numerator's weights);
4. divides by the row sums and stores the tile as a `[block_t, block_y,
   block_x, D]` block of the output (masked at the grid's edges).

Every query row has visible keys in the chunks that hold its window, but a
chunk may hold none of a row's keys: such rows keep a -inf running max and
subtract 0 instead (no NaN).

Wasted work: each of the tile's `Q` queries is scored against the whole halo
box, `prod(block + k - 1)` keys rounded up to `block_k`, of which its window
is `KT * KY * KX`. The heuristic picks the tile shape that minimizes the
scored pairs (including edge tiles) for the problem (the useful fractions
at the recorded grids: docs/perf/kernel_notes.md). Besides the two dots,
each scored pair costs about 6 CUDA-core operations (the window bits' and
and compare, the select, the max, one fma and one exp2), about as much
issue time as the tensor cores take (docs/perf/kernel_notes.md).

On sm_90a the 64-query tiles run both dots as wgmma and the gathered K/V
chunks through `cp.async`, without spills (docs/perf/sm90a_compile.md).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.neighborhood_attention.config import NeighborhoodAttentionBwdConfig, NeighborhoodAttentionConfig
from pallas_kernels.neighborhood_attention.tiles import (
  SlotTables,
  halo_box,
  halo_slots,
  query_box,
  slot_operands,
  store_tile,
  tile_points,
  tile_spec,
  walk_halo,
)
from pallas_kernels.neighborhood_attention.triton_bwd import Static, with_backward
from pallas_kernels.shared import common
from pallas_kernels.shared.common import cdiv, check_pow2_dim, next_pow2, resolve_interpret
from pallas_kernels.shared.online_softmax import (
  LOG2_E,
  init_carry,
  lse_for_backward,
  normalize,
  online_softmax_step,
  row_sums,
)

# ---------------------------------------------------------------------------
# Heuristic and sweep candidates.


class NeighborhoodAttentionSizes(NamedTuple):
  """Problem sizes of the inputs' shapes (input name -> array or ShapeDtypeStruct)."""

  batch: int
  t: int
  y: int
  x: int
  heads: int
  head_dim: int

  @classmethod
  def of(cls, shapes: Mapping[str, Any]) -> NeighborhoodAttentionSizes:
    return cls(*(int(d) for d in shapes["q"].shape))

  @property
  def grid(self) -> tuple[int, int, int]:
    return (self.t, self.y, self.x)


def halo_size(tile: tuple[int, int, int], window: tuple[int, int, int]) -> int:
  """Keys in the halo box of a query tile: `prod(block + k - 1)`."""
  return math.prod(halo_box(tile, window))


def scored_pairs(config: NeighborhoodAttentionConfig, dims: tuple[int, int, int], window: tuple[int, int, int]) -> int:
  """(query, key) scores one (batch row, head) computes: tiles x tile queries
  x halo keys rounded up to whole chunks (edge tiles count in full)."""
  tiles = math.prod(cdiv(n, b) for n, b in zip(dims, config.tile))
  chunks = cdiv(halo_size(config.tile, window), config.block_k)
  return tiles * config.block_queries * chunks * config.block_k


def _tiles(queries: int, dims: tuple[int, int, int]) -> list[tuple[int, int, int]]:
  """Power-of-two tiles of `queries` points, no side longer than its axis
  needs (next power of two of the extent); for grids of fewer points than
  that, every tile of `queries` points (the excess is masked)."""
  sides = [1 << i for i in range(queries.bit_length())]
  tiles = [(bt, by, queries // (bt * by)) for bt in sides for by in sides if queries % (bt * by) == 0]
  fitting = [t for t in tiles if all(b <= next_pow2(n) for b, n in zip(t, dims))]
  return fitting or tiles


def _best(
  queries: int,
  block_k: int,
  num_warps: int,
  num_stages: int,
  dims: tuple[int, int, int],
  window: tuple[int, int, int],
  pairs=scored_pairs,
) -> NeighborhoodAttentionConfig:
  configs = [
    NeighborhoodAttentionConfig(*tile, block_k=block_k, num_warps=num_warps, num_stages=num_stages)
    for tile in _tiles(queries, dims)
  ]
  # Fewest scored pairs; among equals, the flattest tile in t (shares K/V
  # t-planes with the neighbouring programs), then the widest in x.
  return min(configs, key=lambda c: (pairs(c, dims, window), c.block_t, -c.block_x))


def choose_config(
  shapes: Mapping[str, jax.ShapeDtypeStruct], *, KT: int, KY: int, KX: int
) -> NeighborhoodAttentionConfig:
  """Heuristic: 64-query tiles (one warpgroup: both dots are 64-row wgmma) of
  the shape that scores the fewest (query, key) pairs for this grid and
  window (`scored_pairs`), 64-key chunks, two pipeline stages (K and V
  chunks of 8 KiB each per stage at D=64)."""
  return _best(64, 64, 4, 2, NeighborhoodAttentionSizes.of(shapes).grid, (KT, KY, KX))


def candidate_configs(
  shapes: Mapping[str, jax.ShapeDtypeStruct], *, KT: int, KY: int, KX: int
) -> list[NeighborhoodAttentionConfig]:
  """The heuristic first, then the best tile shapes at 32, 64 and 128 queries
  with 32- and 64-key chunks and a few warp / stage counts, no duplicates."""
  dims, window = NeighborhoodAttentionSizes.of(shapes).grid, (KT, KY, KX)
  out = [choose_config(shapes, KT=KT, KY=KY, KX=KX)]
  for queries, block_k, warps, stages in (
    (64, 32, 4, 2),
    (64, 64, 4, 3),
    (128, 64, 8, 2),
    (128, 32, 4, 2),
    (32, 64, 2, 2),
    (64, 64, 8, 2),
  ):
    out.append(_best(queries, block_k, warps, stages, dims, window))
  return list(dict.fromkeys(out))


def _dkdv_pairs(config: NeighborhoodAttentionConfig, dims: tuple[int, int, int], window: tuple[int, int, int]) -> int:
  """(key, query) pairs the dK/dV kernel scores per (batch row, head) with
  `config` as its key tile and `block_k` queries per chunk."""
  tiles = math.prod(cdiv(n, b) for n, b in zip(dims, config.tile))
  return (
    tiles
    * config.block_queries
    * cdiv(math.prod(query_box(dims, window, config.tile)), config.block_k)
    * config.block_k
  )


def choose_backward_config(
  shapes: Mapping[str, jax.ShapeDtypeStruct], *, KT: int, KY: int, KX: int
) -> NeighborhoodAttentionBwdConfig:
  """Heuristic: dQ as the forward (`choose_config`); dK/dV 64-key tiles of
  the shape that scores the fewest pairs over its query boxes, 64 queries
  per chunk, 8 warps (two fp32 `[64, D]` accumulators), two stages."""
  dims, window = NeighborhoodAttentionSizes.of(shapes).grid, (KT, KY, KX)
  return NeighborhoodAttentionBwdConfig(
    dq=choose_config(shapes, KT=KT, KY=KY, KX=KX), dkdv=_best(64, 64, 8, 2, dims, window, pairs=_dkdv_pairs)
  )


# ---------------------------------------------------------------------------
# Kernel.


def _neighborhood_attention_kernel(
  q_ref,
  k_ref,
  v_ref,
  offsets_ref,
  tests_ref,
  o_ref,
  *lse_ref,
  dims,
  window,
  tile,
  block_k: int,
  tables: SlotTables,
  ptx: bool,
):
  """One query tile of one (batch row, head). Refs are `[N, D]` rows of the
  flattened grid (`N = T * Y * X`) and the halo's slot tables (`tables`
  describes them); with `lse_ref` (the tile's block), also the per-query
  log-sum-exp the backward recomputes probabilities from."""
  queries = tile_points(dims, tile)
  q = q_ref[queries.rows, :]

  def step(k, v, visible, carry):
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32)  # q is pre-scaled
    return online_softmax_step(
      s, carry, v, visible=visible, score_scale=LOG2_E, fma_ptx=ptx, row_sums_by_dot=True, finite_max=True
    )

  carry = init_carry(q.shape[0], q.shape[1], row_sums_by_dot=True, finite_max=True)
  o, m, l = walk_halo(step, carry, k_ref, v_ref, (offsets_ref, tests_ref), tables, queries, dims, window, tile, block_k)
  l = row_sums(l)
  store_tile(o_ref, normalize(o, m, l).astype(o_ref.dtype), queries, dims, tile)  # l >= 1: every row sees its window
  if lse_ref:
    store_tile(lse_ref[0], lse_for_backward(m, l), queries, dims, tile)


def _forward(q, k, v, *, window, config: NeighborhoodAttentionConfig, interpret: bool, with_lse: bool):
  """One launch of the forward kernel: `o`, and with `with_lse` also
  `lse [B, H, T, Y, X]` (base 2)."""
  batch, *dims, num_heads, head_dim = q.shape
  dims = tuple(dims)
  n = math.prod(dims)
  flat = lambda a: a.reshape(batch, n, num_heads, head_dim)  # noqa: E731
  # K/V (and Q) blocks span the grid of one (batch row, head): the kernel
  # gathers rows by index, so their length need not be a power of two.
  spec = pl.BlockSpec((None, n, None, head_dim), lambda i, b, h: (b, 0, h, 0))
  out_shape, out_specs = [jax.ShapeDtypeStruct(q.shape, q.dtype)], [tile_spec(dims, config.tile, head_dim)]
  if with_lse:
    out_shape.append(jax.ShapeDtypeStruct((batch, num_heads, *dims), jnp.float32))
    out_specs.append(tile_spec(dims, config.tile, None))
  tables = halo_slots(dims, window, config.tile, config.block_k)
  slots, slot_specs = slot_operands(tables)
  kernel = functools.partial(
    _neighborhood_attention_kernel,
    dims=dims,
    window=window,
    tile=config.tile,
    block_k=config.block_k,
    tables=tables,
    ptx=not interpret,
  )
  outs = common.pallas_call(
    kernel,
    out_shape=out_shape,
    grid=(math.prod(cdiv(d, b) for d, b in zip(dims, config.tile)), batch, num_heads),
    in_specs=[spec, spec, spec, *slot_specs],
    out_specs=out_specs,
    compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
    interpret=interpret,
    name="neighborhood_attention_3d",
  )(flat(q), flat(k), flat(v), *slots)
  return tuple(outs) if with_lse else outs[0]


_attention = with_backward(
  lambda q, k, v, static, with_lse: _forward(
    q, k, v, window=static.window, config=static.config, interpret=static.interpret, with_lse=with_lse
  )
)


def check_inputs(q, k, v, KT: int, KY: int, KX: int) -> tuple[int, int, int]:
  """The window `(KT, KY, KX)` of inputs every backend takes (a ValueError
  otherwise): q, k, v `[B, T, Y, X, H, D]` of one shape and dtype, D a
  power of two >= 16, `1 <= k <= extent` on each axis."""
  if k.shape != q.shape or v.shape != q.shape:
    raise ValueError(f"k {k.shape} / v {v.shape} do not match q {q.shape}")
  if not (k.dtype == v.dtype == q.dtype):
    raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
  check_pow2_dim("head dim D", q.shape[-1])
  window = (int(KT), int(KY), int(KX))
  dims = tuple(q.shape[1:4])
  if any(w < 1 or n < w for n, w in zip(dims, window)):
    raise ValueError(f"window {window} does not fit the grid {dims} (need 1 <= k <= extent)")
  return window


@functools.partial(jax.jit, static_argnames=("KT", "KY", "KX", "config", "backward_config", "interpret"))
def neighborhood_attention_3d(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  KT: int,
  KY: int,
  KX: int,
  config: NeighborhoodAttentionConfig | None = None,
  backward_config: NeighborhoodAttentionBwdConfig | None = None,
  interpret: bool | None = None,
) -> jax.Array:
  """3-D neighborhood attention, NATTEN semantics, no extra scale.

  Args:
    q, k, v: `[B, T, Y, X, H, D]`, one dtype; `D` a power of two >= 16; `q`
      already scaled. B = 0 gives an empty result.
    KT, KY, KX: window sizes along T, Y, X; `1 <= KT <= T`, `1 <= KY <= Y`,
      `1 <= KX <= X` (a ValueError otherwise).
    config: tiling; None = `choose_config`.
    backward_config: tilings of the backward kernels; None =
      `choose_backward_config`.
    interpret: None = interpret when no GPU is present.

  Differentiable (`jax.custom_vjp`) in q, k and v: dQ and dK/dV kernels
  over the same tiles (`neighborhood_attention_bwd`).

  Returns:
    `o [B, T, Y, X, H, D]` in `q.dtype`.
  """
  window = check_inputs(q, k, v, KT, KY, KX)
  batch, *_, num_heads, _ = q.shape
  if not (batch and num_heads):
    return jnp.zeros(q.shape, q.dtype)
  shapes = {"q": jax.ShapeDtypeStruct(q.shape, q.dtype)}
  static = Static(
    window,
    config or choose_config(shapes, KT=KT, KY=KY, KX=KX),
    backward_config or choose_backward_config(shapes, KT=KT, KY=KY, KX=KX),
    resolve_interpret(interpret),
  )
  return _attention(q, k, v, static)
