"""QSA indexer decode (Qwen sparse attention): paged index scores + exact
top-k, all in Pallas.

For sequence b with compressed length `n = seq_lens[b] // C` (clamped to
[0, MP * P]: ids past the page table do not exist), logical block `j < n`
lives in physical page `page_table[b, j // P]`, slot `j % P` of
`index_k [NP, P, 1, D]`, and scores

    score[b, j] = sum_h relu(q[b, h] . index_k[page, j % P]) / sqrt(D)

in fp32. A block whose page-table entry is outside [0, NP) is absent: it is
no candidate. The output is the top-`TOPK` candidate ids by score (ties to
the lower id; NaN scores rank first, as in XLA's TopK), ascending, with a -1
suffix when there are fewer than `TOPK` candidates.

Two stages (`QsaIndexConfig(score=ScoreStage, select=SelectStage)`), three
Pallas launches and one XLA memset (the selection's zeroed row totals):

1. Scores (Pallas). Grid `(B, chunks)`: program (b, c) owns the `chunk_keys`
   logical ids `[c * chunk_keys, (c + 1) * chunk_keys)` of sequence b, so one
   long sequence (B=1, n ~ 62k at 249k tokens) still spreads over the whole
   GPU. It walks its chunk in `block_keys` steps; each step looks up the
   physical page of every key of the step in the page-table row (a vector
   gather; `block_keys` is a multiple of P, so a step covers whole pages),
   gathers the `[block_keys, D]` key rows from the flattened `[NP * P, D]`
   cache (runs of P contiguous rows, coalesced), and does one tensor-core dot
   with the query heads, gathered from q's `[H, D]` rows into 16 rows whose
   padding rows are masked to zero (`[block_keys, D] x [D, 16]`, fp32
   accumulation). The padded heads score 0 and relu(0) = 0, so the head sum
   runs over all 16 columns. Ids that are no candidate are written as -inf
   without touching the cache (steps wholly past n skip the loads). The
   program also counts its candidates by the first 11-bit digit of their
   order key and adds the counts to the row's totals: the first histogram of
   the selection, for free. Output: f32 `[B, W]` scores.
2. Selection (`radix_select.select_topk`, Pallas): the second digit's
   histogram, then the write pass, which counts the last digit of the
   boundary group and whose last program per row writes the ids (4 bytes
   per id read by each, against the 256 bytes per id stage 1 reads); each
   program replays the digits chosen so far from the row's totals, so
   nothing runs between the launches; exact, ties to the lower id, the ids
   come out ascending. No sort anywhere.

Masks come from `program_id` and iotas; page-table and cache gathers are
masked (and their indices clamped) so nothing outside the inputs is read.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.qsa_index.config import QsaIndexConfig, ScoreStage
from pallas_kernels.shared import common, radix_select
from pallas_kernels.shared.common import MIN_DOT_DIM, cdiv, check_pow2_dim, next_pow2, resolve_interpret
from pallas_kernels.shared.device import num_sms
from pallas_kernels.shared.radix_select import HIST_COLS, HIST_ROWS, SelectStage


class QsaIndexSizes(NamedTuple):
  """Problem sizes of the inputs' shapes (input name -> array or ShapeDtypeStruct)."""

  batch: int
  max_pages: int  # page-table width MP
  page: int  # compressed keys per page P

  @classmethod
  def of(cls, shapes: Mapping[str, Any]) -> QsaIndexSizes:
    batch, max_pages = shapes["page_table"].shape
    return cls(int(batch), int(max_pages), int(shapes["index_k"].shape[1]))


def _fit(config: QsaIndexConfig, ids: int, page: int) -> QsaIndexConfig:
  """Shrinks the blocks to the id range (tiny MP); keeps whole pages per
  step; widens the selection's chunks to at most `radix_select.MAX_CHUNKS`
  per padded row."""
  score = config.score
  block = max(MIN_DOT_DIM, next_pow2(page), min(score.block_keys, next_pow2(ids)))
  chunk = max(block, min(score.chunk_keys, next_pow2(ids)))
  fitted = QsaIndexConfig(
    score=dataclasses.replace(score, block_keys=block, chunk_keys=chunk),
    select=radix_select.fit_stage(config.select, ids),
  )
  while score_width(fitted, ids) // fitted.select.chunk_keys > radix_select.MAX_CHUNKS:
    select = fitted.select
    fitted = dataclasses.replace(fitted, select=dataclasses.replace(select, chunk_keys=2 * select.chunk_keys))
  return fitted


def score_width(config: QsaIndexConfig, ids: int) -> int:
  """W: the score row's width, `ids` rounded up to whole chunks of both stages."""
  chunk = max(config.score.chunk_keys, config.select.chunk_keys)
  return cdiv(max(ids, 1), chunk) * chunk


def choose_config(shapes: Mapping[str, Any]) -> QsaIndexConfig:
  """Heuristic: 128-id steps (8 pages, 32 KiB of keys per step, 2 stages in
  flight) and the longest score chunk in [256, 8192] ids that still gives
  about two programs per SM. Recorded extremes: B=1, MP=3895 (n up to 62k
  ids) gets 256-id score chunks, 244 programs; B=23, MP=517 gets 512-id
  chunks, 391 programs. Long chunks amortize the query load and the program
  start; short ones fill the GPU. The selection's passes read 4 bytes per
  id in 128-id steps (the one-hot operands of a 2048-bin histogram of 256
  ids need about twice the registers), 4 warps, over the same chunks where
  a row has at most `radix_select.MAX_CHUNKS` of them (B=1, MP=3895: 61
  chunks of 1024 ids); the last program's walk takes 128 items a step
  (about topk items in all on real scores: 4 steps)."""
  batch, max_pages, page = QsaIndexSizes.of(shapes)
  ids = max_pages * page
  chunk = 8192
  while chunk > 256 and batch * cdiv(ids, chunk) < 2 * num_sms():
    chunk //= 2
  score = ScoreStage(block_keys=128, chunk_keys=chunk, num_warps=4, num_stages=2)
  select = SelectStage(block_keys=min(128, chunk), chunk_keys=chunk, num_warps=4, num_stages=2, write_block=128)
  return _fit(QsaIndexConfig(score=score, select=select), ids, page)


_SWEEP = (
  QsaIndexConfig(ScoreStage(128, 1024, num_warps=4, num_stages=2), SelectStage(256, 1024, num_warps=4)),
  QsaIndexConfig(ScoreStage(128, 2048, num_warps=4, num_stages=3), SelectStage(256, 2048, num_warps=8)),
  QsaIndexConfig(ScoreStage(256, 2048, num_warps=8, num_stages=2), SelectStage(128, 512, num_warps=4, write_block=64)),
  QsaIndexConfig(ScoreStage(64, 512, num_warps=4, num_stages=3), SelectStage(128, 256, num_warps=4, write_block=256)),
  QsaIndexConfig(ScoreStage(256, 4096, num_warps=8, num_stages=3), SelectStage(256, 4096, num_warps=8)),
)


def candidate_configs(shapes: Mapping[str, jax.ShapeDtypeStruct]) -> list[QsaIndexConfig]:
  """Heuristic first, then the sweep's tilings fitted to the shapes."""
  _, max_pages, page = QsaIndexSizes.of(shapes)
  chosen = choose_config(shapes)
  return list(dict.fromkeys([chosen, *(_fit(c, max_pages * page, page) for c in _SWEEP)]))


def _score_kernel(
  q_ref,
  k_ref,
  pt_ref,
  len_ref,
  _,
  o_ref,
  totals_ref,
  *,
  block_keys: int,
  chunk_keys: int,
  page: int,
  max_pages: int,
  num_pages: int,
  compress: int,
  scale: float,
  interpret: bool,
):
  # q_ref [H, D], k_ref [NP * P, D], pt_ref [MP], len_ref [1] (tokens),
  # o_ref [chunk_keys] f32, totals_ref the row's selection counts (aliased
  # to the zeroed input `_`): this chunk's candidates by first key digit are
  # added.
  chunk_start = pl.program_id(1) * chunk_keys
  # Complete blocks, clamped to the ids the page table reaches (a negative
  # length truncates or floors to at most 0: either way n = 0).
  n = jnp.clip(len_ref[0] // compress, 0, max_pages * page)
  steps = chunk_keys // block_keys
  live = jnp.clip((n - chunk_start + block_keys - 1) // block_keys, 0, steps)
  heads, head_dim = q_ref.shape
  cols = jnp.arange(head_dim, dtype=jnp.int32)
  # The heads as the 16 rows of a dot operand: rows past H read as zero.
  head = jnp.arange(max(MIN_DOT_DIM, next_pow2(heads)), dtype=jnp.int32)
  q = plgpu.load(
    q_ref.at[jnp.minimum(head, heads - 1)[:, None], cols[None, :]], mask=(head < heads)[:, None], other=0.0
  )
  lane = jnp.arange(block_keys, dtype=jnp.int32)

  def score_step(i, hist):
    ids = chunk_start + i * block_keys + lane
    valid = ids < n
    logical_page = jnp.minimum(ids // page, max_pages - 1)
    phys = plgpu.load(pt_ref.at[logical_page], mask=valid, other=0)
    valid = valid & (phys >= 0) & (phys < num_pages)  # an absent page holds no candidate
    rows = jnp.where(valid, phys * page + ids % page, 0)
    # Gather whole rows with two broadcast index vectors (rows x columns):
    # lowers to one pointer tensor, and interprets (a vector-and-slice
    # index does not).
    k = plgpu.load(k_ref.at[rows[:, None], cols[None, :]], mask=valid[:, None], other=0.0)
    s = jnp.dot(k, q.T, preferred_element_type=jnp.float32)  # [block_keys, Hp]
    # relu by select: Triton's float max is maxnum, which would drop a NaN.
    score = jnp.sum(jnp.where(s < 0.0, 0.0, s), axis=1) * scale
    score = jnp.where(score != score, jnp.nan, score)  # one NaN: ranks first
    o_ref[pl.ds(i * block_keys, block_keys)] = jnp.where(valid, score, -jnp.inf)
    digits = radix_select.digit_of(radix_select.order_key(score), 0)
    return hist + radix_select.digit_histogram(digits, valid)

  def empty_step(i, carry):
    o_ref[pl.ds(i * block_keys, block_keys)] = jnp.full((block_keys,), -jnp.inf, jnp.float32)
    return carry

  hist = lax.fori_loop(0, live, score_step, jnp.zeros((HIST_ROWS, HIST_COLS), jnp.int32))
  lax.fori_loop(live, steps, empty_step, 0)
  radix_select.add_histogram(totals_ref, 0, hist, interpret=interpret)


def index_scores(
  q: jax.Array,
  index_k: jax.Array,
  page_table: jax.Array,
  seq_lens: jax.Array,
  *,
  compress: int,
  config: QsaIndexConfig,
  interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Stage 1: f32 `[B, W]` scores by logical id, -inf for ids that are no
  candidate (>= n, or on an absent page), W = `score_width`; and the
  selection's row totals (`radix_select.totals_shape`) holding the first
  digit's counts. `config` fitted (`_fit`)."""
  batch, heads, head_dim = q.shape
  num_pages, page, kv_heads, _ = index_k.shape
  max_pages = page_table.shape[1]
  if kv_heads != 1:
    raise ValueError(f"index_k must have one key head, got {index_k.shape}")
  check_pow2_dim("head dim D", head_dim)
  score = config.score
  if score.block_keys % page:
    raise ValueError(f"block_keys={score.block_keys} must cover whole pages of {page} keys")
  width = score_width(config, max_pages * page)
  chunks = width // score.chunk_keys
  interpret = resolve_interpret(interpret)
  k_flat = index_k.reshape(num_pages * page, head_dim)
  kernel = functools.partial(
    _score_kernel,
    block_keys=score.block_keys,
    chunk_keys=score.chunk_keys,
    page=page,
    max_pages=max_pages,
    num_pages=num_pages,
    compress=compress,
    scale=1.0 / math.sqrt(head_dim),
    interpret=interpret,
  )
  return common.pallas_call(
    kernel,
    out_shape=(jax.ShapeDtypeStruct((batch, width), jnp.float32), radix_select.totals_shape(batch)),
    grid=(batch, chunks),
    in_specs=[
      pl.BlockSpec((None, heads, head_dim), lambda b, c: (b, 0, 0)),
      pl.BlockSpec((num_pages * page, head_dim), lambda b, c: (0, 0)),
      pl.BlockSpec((None, max_pages), lambda b, c: (b, 0)),
      pl.BlockSpec((None, 1), lambda b, c: (b, 0)),
      radix_select.totals_spec(),
    ],
    out_specs=(pl.BlockSpec((None, score.chunk_keys), lambda b, c: (b, c)), radix_select.totals_spec()),
    input_output_aliases={4: 1},
    compiler_params=plgpu.CompilerParams(num_warps=score.num_warps, num_stages=score.num_stages),
    interpret=interpret,
    name="qsa_index_scores",
  )(
    q,
    k_flat,
    page_table.astype(jnp.int32),
    seq_lens.astype(jnp.int32).reshape(batch, 1),
    jnp.zeros(radix_select.totals_shape(batch).shape, jnp.int32),
  )


@functools.partial(jax.jit, static_argnames=("topk", "compress", "config", "interpret"))
def qsa_index_topk(
  q: jax.Array,
  index_k: jax.Array,
  page_table: jax.Array,
  seq_lens: jax.Array,
  *,
  topk: int = 512,
  compress: int = 4,
  config: QsaIndexConfig | None = None,
  interpret: bool | None = None,
) -> jax.Array:
  """QSA indexer top-k decode.

  Args:
    q: `[B, H, D]` indexer queries (bf16); D a power of two >= 16.
    index_k: `[NP, P, 1, D]` paged compressed keys, q's dtype.
    page_table: `[B, MP]` int32 physical page of each logical page; an entry
      outside [0, NP) is an absent page (its ids are no candidates).
    seq_lens: `[B]` int32 tokens; `n = seq_lens // compress` blocks, clamped
      to [0, MP * P].
    topk, compress: static (512 and 4 for Qwen3.8).
    config: `QsaIndexConfig`; None = `choose_config`.
    interpret: None = interpret when no GPU is present.

  Returns:
    int32 `[B, topk]`: selected logical ids ascending, -1 suffix when there
    are fewer than topk candidates.
  """
  shapes = {"page_table": page_table, "index_k": index_k}
  if config is None:
    config = choose_config(shapes)
  sizes = QsaIndexSizes.of(shapes)
  if sizes.batch == 0:
    return jnp.zeros((0, topk), jnp.int32)
  config = _fit(config, sizes.max_pages * sizes.page, sizes.page)
  interpret = resolve_interpret(interpret)
  scores, totals = index_scores(q, index_k, page_table, seq_lens, compress=compress, config=config, interpret=interpret)
  return radix_select.select_topk(
    scores, topk=topk, stage=config.select, totals=totals, name="qsa_index", interpret=interpret
  )
