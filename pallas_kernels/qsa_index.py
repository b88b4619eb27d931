"""QSA indexer decode (Qwen sparse attention): paged index scores + top-k.

For sequence b with compressed length `n = seq_lens[b] // C`, logical block
`j < n` lives in physical page `page_table[b, j // P]`, slot `j % P` of
`index_k [NP, P, 1, D]`, and scores

    score[b, j] = sum_h relu(q[b, h] . index_k[page, j % P]) / sqrt(D)

in fp32. The output is the top-`TOPK` block ids by score (ties to the lower
id), sorted ascending, with a `-1` suffix when `n < TOPK`.

Two stages (`QsaIndexConfig(score=ScoreStage, select=SelectStage)`):

1. Scores (Pallas). Grid `(B, chunks)`: program (b, c) owns the `chunk_keys`
   logical ids `[c * chunk_keys, (c + 1) * chunk_keys)` of sequence b, so one
   long sequence (B=1, n ~ 62k at 249k tokens) still spreads over the whole GPU. It walks
   its chunk in `block_keys` steps; each step looks up the physical page of
   every key of the step in the page-table row (a vector gather; `block_keys`
   is a multiple of P, so a step covers whole pages), gathers the
   `[block_keys, D]` key rows from the flattened `[NP * P, D]` cache (runs of
   P contiguous rows, coalesced), and does one tensor-core dot with the query
   heads zero-padded from H=4 to 16 rows (`[block_keys, D] x [D, 16]`, fp32
   accumulation). The padded heads score 0 and relu(0) = 0, so the head sum
   runs over all 16 columns. Ids `>= n` are written as -inf without touching
   the cache (steps wholly past n skip the loads). Output: f32
   `[B, chunks * chunk_keys]`, at least TOPK wide.
2. Selection (XLA). `lax.top_k` (or a stable `lax.sort`, `method="sort"`) on
   that score row: exact, ties to the lower index by XLA's definition of
   TopK; ids whose score is -inf (beyond n) become -1; then the ids are
   sorted ascending with the -1 suffix last. Why XLA and not a Pallas
   select: the score row is 64x smaller than what stage 1 reads (4 bytes per
   id against 256: 250 KB per row at n = 62k), and an exact selection over it
   needs all programs of a row to agree on a threshold, i.e. a grid-wide
   reduction per radix digit. On the Triton lowering that means atomics or
   one launch per digit, which is what XLA's sort already does (a CUB radix
   sort when XLA compiles with a GPU present, a bitonic sort when compiled
   deviceless). A one-program-per-row Pallas select would read the row ~30
   times from one SM, slower than the sort at B=1. So the selection stays in
   XLA, exact and tie-stable; its cost is a handful of launches over a
   small row, not bandwidth. The config keeps it a separate stage so a
   Pallas select can replace it if measurements show the launches matter.

Masks come from `program_id` and iotas; page-table and cache gathers are
masked (and their indices clamped) so nothing outside the inputs is read.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping, NamedTuple

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from pallas_kernels import common
import jax.numpy as jnp

from pallas_kernels.common import MIN_DOT_DIM, cdiv, check_pow2_dim, next_pow2, resolve_interpret
from pallas_kernels.config_rules import (DOT_BLOCK, NUM_STAGES, NUM_WARPS, KernelConfig, field, instance_of,
                                         multiple_of, one_of)
from pallas_kernels.device import num_sms

SELECT_METHODS = ("top_k", "sort")


@dataclasses.dataclass(frozen=True)
class ScoreStage(KernelConfig):
  """Stage 1 tiling: `block_keys` ids per step (also a multiple of the
  page's P keys: checked at launch), `chunk_keys` ids per program."""
  block_keys: int = field(128, DOT_BLOCK)
  chunk_keys: int = field(1024, DOT_BLOCK, multiple_of("block_keys"))
  num_warps: int = field(4, NUM_WARPS)
  num_stages: int = field(2, NUM_STAGES)


@dataclasses.dataclass(frozen=True)
class SelectStage(KernelConfig):
  """Stage 2: `method` is "top_k" (`lax.top_k`) or "sort" (stable `lax.sort`
  by descending score); both exact with ties to the lower id."""
  method: str = field("top_k", one_of(*SELECT_METHODS))


@dataclasses.dataclass(frozen=True)
class QsaIndexConfig(KernelConfig):
  score: ScoreStage = field(ScoreStage(), instance_of(ScoreStage))
  select: SelectStage = field(SelectStage(), instance_of(SelectStage))


class QsaIndexSizes(NamedTuple):
  """Problem sizes of the inputs' shapes (input name -> array or ShapeDtypeStruct)."""
  batch: int
  max_pages: int   # page-table width MP
  page: int        # compressed keys per page P

  @classmethod
  def of(cls, shapes: Mapping[str, Any]) -> QsaIndexSizes:
    batch, max_pages = shapes["page_table"].shape
    return cls(int(batch), int(max_pages), int(shapes["index_k"].shape[1]))


def _fit(score: ScoreStage, ids: int, page: int) -> ScoreStage:
  """Shrinks the blocks to the id range (tiny MP); keeps whole pages per step."""
  block = max(MIN_DOT_DIM, next_pow2(page), min(score.block_keys, next_pow2(ids)))
  chunk = max(block, min(score.chunk_keys, next_pow2(ids)))
  return dataclasses.replace(score, block_keys=block, chunk_keys=chunk)


def choose_config(shapes: Mapping[str, jax.ShapeDtypeStruct]) -> QsaIndexConfig:
  """Heuristic: 128-id steps (8 pages, 32 KiB of keys per step, 2 stages in
  flight) and the longest chunk in [256, 8192] ids that still gives about two
  programs per SM. Recorded extremes: B=1, MP=3895 (n up to 62k ids) gets
  256-id chunks, 244 programs; B=23, MP=517 gets 512-id chunks, 391
  programs. Long chunks amortize the query load and the program start;
  short ones fill the GPU."""
  batch, max_pages, page = QsaIndexSizes.of(shapes)
  ids = max_pages * page
  chunk = 8192
  while chunk > 256 and batch * cdiv(ids, chunk) < 2 * num_sms():
    chunk //= 2
  score = _fit(ScoreStage(block_keys=128, chunk_keys=chunk, num_warps=4, num_stages=2), ids, page)
  return QsaIndexConfig(score=score, select=SelectStage("top_k"))


_SWEEP = (
    ScoreStage(128, 1024, num_warps=4, num_stages=2),
    ScoreStage(128, 2048, num_warps=4, num_stages=3),
    ScoreStage(256, 2048, num_warps=8, num_stages=2),
    ScoreStage(64, 512, num_warps=4, num_stages=3),
    ScoreStage(256, 4096, num_warps=8, num_stages=3),
)


def candidate_configs(shapes: Mapping[str, jax.ShapeDtypeStruct]) -> list[QsaIndexConfig]:
  """Heuristic first, then the sweep's score tilings with each select method."""
  _, max_pages, page = QsaIndexSizes.of(shapes)
  chosen = choose_config(shapes)
  rest = [QsaIndexConfig(_fit(s, max_pages * page, page), SelectStage(m))
          for s in _SWEEP for m in SELECT_METHODS]
  return list(dict.fromkeys([chosen, *rest]))


def _score_kernel(q_ref, k_ref, pt_ref, n_ref, o_ref, *, block_keys: int, chunk_keys: int,
                  page: int, max_pages: int, scale: float):
  # q_ref [Hp, D] (heads zero-padded), k_ref [NP * P, D], pt_ref [MP],
  # n_ref [1] (compressed length), o_ref [chunk_keys] f32.
  chunk_start = pl.program_id(1) * chunk_keys
  n = n_ref[0]
  steps = chunk_keys // block_keys
  live = jnp.clip((n - chunk_start + block_keys - 1) // block_keys, 0, steps)
  q = q_ref[...]
  lane = jnp.arange(block_keys, dtype=jnp.int32)
  cols = jnp.arange(q.shape[-1], dtype=jnp.int32)

  def score_step(i, carry):
    ids = chunk_start + i * block_keys + lane
    valid = ids < n
    logical_page = jnp.minimum(ids // page, max_pages - 1)
    phys = plgpu.load(pt_ref.at[logical_page], mask=valid, other=0)
    rows = jnp.where(valid, phys * page + ids % page, 0)
    # Gather whole rows with two broadcast index vectors (rows x columns):
    # lowers to one pointer tensor, and interprets (a vector-and-slice
    # index does not).
    k = plgpu.load(k_ref.at[rows[:, None], cols[None, :]], mask=valid[:, None], other=0.0)
    s = jnp.dot(k, q.T, preferred_element_type=jnp.float32)  # [block_keys, Hp]
    score = jnp.sum(jnp.maximum(s, 0.0), axis=1) * scale
    o_ref[pl.ds(i * block_keys, block_keys)] = jnp.where(valid, score, -jnp.inf)
    return carry

  def empty_step(i, carry):
    o_ref[pl.ds(i * block_keys, block_keys)] = jnp.full((block_keys,), -jnp.inf, jnp.float32)
    return carry

  lax.fori_loop(0, live, score_step, 0)
  lax.fori_loop(live, steps, empty_step, 0)


def index_scores(q: jax.Array, index_k: jax.Array, page_table: jax.Array, seq_lens: jax.Array, *,
                 compress: int, score: ScoreStage, min_width: int = 0,
                 interpret: bool | None = None) -> jax.Array:
  """Stage 1: f32 `[B, W]` scores by logical id, -inf for ids >= n, where
  W = chunks * chunk_keys >= max(MP * P, min_width)."""
  batch, heads, head_dim = q.shape
  num_pages, page, kv_heads, _ = index_k.shape
  max_pages = page_table.shape[1]
  if kv_heads != 1:
    raise ValueError(f"index_k must have one key head, got {index_k.shape}")
  check_pow2_dim("head dim D", head_dim)
  score = _fit(score, max_pages * page, page)
  if score.block_keys % page:
    raise ValueError(f"block_keys={score.block_keys} must cover whole pages of {page} keys")
  width = max(max_pages * page, min_width, 1)
  chunks = cdiv(width, score.chunk_keys)
  heads_p = max(MIN_DOT_DIM, next_pow2(heads))
  q_p = jnp.pad(q, ((0, 0), (0, heads_p - heads), (0, 0)))
  k_flat = index_k.reshape(num_pages * page, head_dim)
  # Ids past the page table's reach do not exist: clamp n to it.
  n = jnp.minimum(seq_lens.astype(jnp.int32) // compress, max_pages * page).reshape(batch, 1)
  kernel = functools.partial(_score_kernel, block_keys=score.block_keys, chunk_keys=score.chunk_keys,
                             page=page, max_pages=max_pages, scale=1.0 / math.sqrt(head_dim))
  return common.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((batch, chunks * score.chunk_keys), jnp.float32),
      grid=(batch, chunks),
      in_specs=[
          pl.BlockSpec((None, heads_p, head_dim), lambda b, c: (b, 0, 0)),
          pl.BlockSpec((num_pages * page, head_dim), lambda b, c: (0, 0)),
          pl.BlockSpec((None, max_pages), lambda b, c: (b, 0)),
          pl.BlockSpec((None, 1), lambda b, c: (b, 0)),
      ],
      out_specs=pl.BlockSpec((None, score.chunk_keys), lambda b, c: (b, c)),
      compiler_params=plgpu.CompilerParams(num_warps=score.num_warps, num_stages=score.num_stages),
      interpret=resolve_interpret(interpret),
      name="qsa_index_scores",
  )(q_p, k_flat, page_table.astype(jnp.int32), n)


def select_topk(scores: jax.Array, n: jax.Array, topk: int, method: str = "top_k") -> jax.Array:
  """Stage 2: the `topk` best ids of each row of `scores` (ties to the lower
  id; ids >= n[b] are -1), sorted ascending with the -1 suffix last. Needs
  `scores.shape[1] >= topk`."""
  if method == "top_k":
    _, ids = lax.top_k(scores, topk)
  elif method == "sort":
    iota = lax.broadcasted_iota(jnp.int32, scores.shape, 1)
    _, ids = lax.sort((-scores, iota), dimension=1, is_stable=True, num_keys=1)
    ids = ids[:, :topk]
  else:
    raise ValueError(f"unknown select method {method!r}")
  ids = ids.astype(jnp.int32)
  big = jnp.iinfo(jnp.int32).max
  keyed = jnp.sort(jnp.where(ids < n[:, None], ids, big), axis=1)
  return jnp.where(keyed == big, -1, keyed)


@functools.partial(jax.jit, static_argnames=("topk", "compress", "config", "interpret"))
def qsa_index_topk(q: jax.Array, index_k: jax.Array, page_table: jax.Array, seq_lens: jax.Array, *,
                   topk: int = 512, compress: int = 4, config: QsaIndexConfig | None = None,
                   interpret: bool | None = None) -> jax.Array:
  """QSA indexer top-k decode.

  Args:
    q: `[B, H, D]` indexer queries (bf16); D a power of two >= 16.
    index_k: `[NP, P, 1, D]` paged compressed keys, q's dtype.
    page_table: `[B, MP]` int32 physical page of each logical page.
    seq_lens: `[B]` int32 tokens; `n = seq_lens // compress` blocks.
    topk, compress: static (512 and 4 for Qwen3.8).
    config: `QsaIndexConfig`; None = `choose_config`.
    interpret: None = interpret when no GPU is present.

  Returns:
    int32 `[B, topk]`: selected logical ids ascending, -1 suffix when n < topk.
  """
  if config is None:
    config = choose_config({"page_table": page_table, "index_k": index_k})
  scores = index_scores(q, index_k, page_table, seq_lens, compress=compress, score=config.score,
                        min_width=topk, interpret=interpret)
  n = seq_lens.astype(jnp.int32) // compress
  return select_topk(scores, n, topk, config.select.method)
