"""Exact top-k of score rows by radix select, in Pallas: no sort.

For each row of f32 `scores [B, W]`, the ids of the `topk` largest scores
among the row's candidates (every score but -inf, which marks "no candidate"),
ties to the lower id, returned in increasing id order with a -1 suffix when a
row has fewer than `topk` candidates. Scores are ranked in the total order of
floats that XLA's TopK uses (-inf < ... < -0 < +0 < ... < +inf < NaN, every
NaN taken as +NaN whatever its sign bit), through their order key: the f32
bits as an unsigned integer with the sign bit flipped for positives and
every bit flipped for negatives.

The threshold T (the key of the `topk`-th best candidate) is found one digit
of the key at a time, most significant first, as in a radix sort: three
digits of 11, 11 and 10 bits (`DIGIT_BITS`). Every pass has the grid
`(B, chunks)` and reads 4 bytes per id:

1. Digit histograms: each program counts, for its chunk of the row, the
   candidates whose higher digits equal the prefix found so far, by their
   next digit: 2048 bins as a 32 x 64 matrix, one tensor-core dot per step
   of two one-hot matrices (high 5 and low 6 bits of the digit, int8 0/1,
   int32 counts), then adds the nonzero ones atomically to the row's totals
   `[B, 3, 32, 64]` (zeroed once, threaded through every pass). The first
   digit's counts can come from the kernel that computes the scores
   (`add_histogram` there), which saves a pass.
2. Each program of the next pass replays the choices from the totals of the
   digits before it (a few scans of 2048 counts): a digit is the largest bin
   whose candidates with a digit at or above it reach the number still to
   select, r; r drops by the count strictly above it. So no glue runs
   between passes.
3. Write pass (the last digit's histogram and the write in one launch):
   after two digits the 22-bit prefix P of T is known. Each program keeps
   its chunk's *items*, the candidates whose 22-bit prefix is >= P (the ones
   above P are all selected, the ones equal to P are the boundary group),
   compacted in id order into its chunk's region of a row list (ids and
   keys) with their count, adds the group's last-digit histogram to the
   totals, and arrives at the row's counter (`last_program`). The last
   program of the row to arrive finds T and the number r of candidates
   equal to T to take (the lowest ids among them), then walks the row's
   items in id order (chunk by chunk, offsets from the counts: at most
   `topk` above P plus the boundary group, whatever the row's width), takes
   every item above T and the ties whose rank is below r, and stores each
   taken id at its output position (prefix sums within the step), until
   every selected id is taken, then writes the -1 suffix. The output is therefore already in increasing id order.

Launches: the zeroed totals (an XLA memset), the first digit's histogram
(a pass here, or the kernel that computes the scores), the second digit's,
and the write pass. The row counter lives in the totals' last cell, which
is no bin of the 10-bit last digit. Interpret mode: atomics without masks
(SPEC 2), which `last_program` keeps to there.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.shared import common
from pallas_kernels.shared.common import cdiv, next_pow2, resolve_interpret
from pallas_kernels.shared.config_rules import DOT_BLOCK, NUM_STAGES, NUM_WARPS, KernelConfig, field, multiple_of, pow2
from pallas_kernels.shared.fp_formats import f32_bits_one_nan
from pallas_kernels.shared.last_program import add_nonzero, arrive

DIGIT_BITS = (11, 11, 10)  # most significant first; they cover the 32-bit key
DIGITS = len(DIGIT_BITS)
LOW_BITS = 6  # a digit's bins as HIST_ROWS x HIST_COLS (high, low bits)
HIST_ROWS = 1 << (max(DIGIT_BITS) - LOW_BITS)
HIST_COLS = 1 << LOW_BITS
BINS = HIST_ROWS * HIST_COLS
# The row's counter of the write pass: the last cell of the last digit's
# tile, which is no bin of that (narrower) digit.
_TICKET = (DIGITS - 1, HIST_ROWS - 1, HIST_COLS - 1)
assert sum(DIGIT_BITS) == 32 and 1 << DIGIT_BITS[-1] <= BINS - 1
# The write pass's row list is walked chunk by chunk with every chunk's
# offset in registers: at most this many chunks a row (`fit_stage`).
MAX_CHUNKS = 64
_SIGN = -(2**31)  # int32 with only the sign bit set


@dataclasses.dataclass(frozen=True)
class SelectStage(KernelConfig):
  """Tiling of the histogram and write passes: `block_keys` ids per step,
  `chunk_keys` ids per program (at most `MAX_CHUNKS` chunks a row: widened
  by `fit_stage`); `write_block`: items per step of the last program's walk
  of the row's items."""

  block_keys: int = field(256, DOT_BLOCK)
  chunk_keys: int = field(1024, DOT_BLOCK, multiple_of("block_keys"))
  num_warps: int = field(4, NUM_WARPS)
  num_stages: int = field(2, NUM_STAGES)
  write_block: int = field(128, pow2(16))


def fit_stage(stage: SelectStage, width: int) -> SelectStage:
  """Shrinks the blocks to the row width (a short row: one small program)
  and widens the chunks to at most `MAX_CHUNKS` a row."""
  block = max(16, min(stage.block_keys, next_pow2(width)))
  chunk = max(block, min(stage.chunk_keys, next_pow2(width)), next_pow2(cdiv(max(width, 1), MAX_CHUNKS)))
  return dataclasses.replace(stage, block_keys=block, chunk_keys=chunk)


# ---------------------------------------------------------------------------
# Pieces shared by the kernels (also the kernel that computes the scores).


def order_key(scores: jax.Array) -> jax.Array:
  """int32 bits whose *unsigned* order is the total order of the f32 scores,
  every NaN counted as +NaN (the top of the order) whatever its sign bit."""
  bits = f32_bits_one_nan(scores)
  return bits ^ ((bits >> 31) | jnp.int32(_SIGN))


def _shift(digit: int) -> int:
  """Bits of the key below `digit`."""
  return 32 - sum(DIGIT_BITS[: digit + 1])


def digit_of(key: jax.Array, digit: int) -> jax.Array:
  """The `digit`-th digit of an order key (0: the most significant)."""
  return lax.shift_right_logical(key, jnp.int32(_shift(digit))) & ((1 << DIGIT_BITS[digit]) - 1)


def higher_digits(key: jax.Array, digit: int) -> jax.Array:
  """The digits of an order key above `digit` (`digit` >= 1), as a
  non-negative int32 (< 2**31: signed compares order them)."""
  return lax.shift_right_logical(key, jnp.int32(_shift(digit - 1)))


def digit_histogram(digits: jax.Array, counted: jax.Array) -> jax.Array:
  """int32 `[HIST_ROWS, HIST_COLS]` counts of `digits [n]` (< BINS) where
  `counted`, by (high bits, low bits): one integer dot of two int8 one-hot
  matrices (int8 halves the operands' shared memory against bf16)."""
  rows = jnp.arange(HIST_ROWS, dtype=jnp.int32)
  cols = jnp.arange(HIST_COLS, dtype=jnp.int32)
  high = ((digits[None, :] >> LOW_BITS) == rows[:, None]) & counted[None, :]  # [rows, n]
  low = (digits[:, None] & (HIST_COLS - 1)) == cols[None, :]  # [n, cols]
  return jnp.dot(high.astype(jnp.int8), low.astype(jnp.int8), preferred_element_type=jnp.int32)


def totals_shape(batch: int) -> jax.ShapeDtypeStruct:
  """The running counts per row and digit, `[B, DIGITS, HIST_ROWS,
  HIST_COLS]` int32, zero at the start (the write pass's row counter
  included)."""
  return jax.ShapeDtypeStruct((batch, DIGITS, HIST_ROWS, HIST_COLS), jnp.int32)


def totals_spec() -> pl.BlockSpec:
  """Every program of row b sees the row's totals (grids `(B, chunks)`)."""
  return pl.BlockSpec((None, DIGITS, HIST_ROWS, HIST_COLS), lambda b, c: (b, 0, 0, 0))


def add_histogram(totals_ref, digit: int, hist: jax.Array, *, interpret: bool) -> None:
  """Adds a chunk's counts of `digit` to the row's totals (its nonzero bins
  only, on a GPU)."""
  add_nonzero(totals_ref, (jnp.int32(digit), pl.ds(0, HIST_ROWS), pl.ds(0, HIST_COLS)), hist, interpret=interpret)


def _total(x: jax.Array) -> jax.Array:
  return jnp.sum(jnp.sum(x, axis=1), axis=0)  # one axis at a time: lowers


def _exclusive_cumsum(x: jax.Array, axis: int = 0) -> jax.Array:
  return jnp.cumsum(x, axis=axis) - x


def _flat_bins() -> jax.Array:
  shape = (HIST_ROWS, HIST_COLS)
  return lax.broadcasted_iota(jnp.int32, shape, 0) * HIST_COLS + lax.broadcasted_iota(jnp.int32, shape, 1)


def _at_or_above(hist: jax.Array) -> jax.Array:
  """Per bin d = HIST_COLS * h + l, the counts of the bins >= d."""
  rows = jnp.sum(hist, axis=1)
  rows_above = jnp.sum(rows) - jnp.cumsum(rows)  # bins of the rows h' > h
  return rows_above[:, None] + rows[:, None] - _exclusive_cumsum(hist, axis=1)


def _boundary(hist: jax.Array, remaining: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(digit, r'): the bin holding the `remaining`-th best of the counted
  candidates, and how many to take from it."""
  at_or_above = _at_or_above(hist)
  digit = jnp.clip(_total((at_or_above >= remaining).astype(jnp.int32)) - 1, 0, BINS - 1)
  above = _total(jnp.where(_flat_bins() == digit, at_or_above - hist, 0))
  return digit, remaining - above


def _replay(totals_ref, digits: int, topk: int):
  """(prefix, r, selected) after the first `digits` digits: the higher
  digits of T, the number still to select among the candidates with that
  prefix, and the number of ids the row selects."""
  selected = jnp.minimum(_total(totals_ref[0]), topk)
  prefix, remaining = jnp.int32(0), selected
  for d in range(digits):
    hist = totals_ref[d]
    if 1 << DIGIT_BITS[d] < BINS:  # cells past the digit's bins (the row counter)
      hist = jnp.where(_flat_bins() < 1 << DIGIT_BITS[d], hist, 0)
    digit, remaining = _boundary(hist, remaining)
    prefix = (prefix << DIGIT_BITS[d]) | digit
  return prefix, remaining, selected


# ---------------------------------------------------------------------------
# Kernels.


def _hist_kernel(s_ref, totals_in_ref, totals_ref, *, block: int, digit: int, topk: int, interpret: bool):
  # s_ref [chunk] f32; totals_in_ref / totals_ref the row's counts (aliased:
  # read the digits before, add this one).
  prefix = _replay(totals_in_ref, digit, topk)[0] if digit else None

  def step(i, hist):
    s = s_ref[pl.ds(i * block, block)]
    key = order_key(s)
    counted = s != -jnp.inf
    if digit:
      counted = counted & (higher_digits(key, digit) == prefix)
    return hist + digit_histogram(digit_of(key, digit), counted)

  hist = lax.fori_loop(0, s_ref.shape[0] // block, step, jnp.zeros((HIST_ROWS, HIST_COLS), jnp.int32))
  add_histogram(totals_ref, digit, hist, interpret=interpret)


def _write_kernel(
  s_ref,
  totals_in_ref,
  totals_ref,
  item_id_ref,
  item_key_ref,
  count_ref,
  o_ref,
  *,
  block: int,
  write_block: int,
  chunks: int,
  topk: int,
  interpret: bool,
):
  # s_ref [chunk] f32; totals_in_ref / totals_ref the row's counts (aliased);
  # item_id_ref / item_key_ref [W] the row's items, chunk c's compacted at
  # the start of its own chunk; count_ref [chunks] items per chunk;
  # o_ref [topk] the row's ids.
  c = pl.program_id(1)
  chunk = s_ref.shape[0]
  last = DIGITS - 1
  prefix = _replay(totals_in_ref, last, topk)[0]  # the 22-bit prefix P of T
  lane = jnp.arange(block, dtype=jnp.int32)
  past_row = item_id_ref.shape[0]

  def step(i, carry):
    hist, count = carry
    s = s_ref[pl.ds(i * block, block)]
    key = order_key(s)
    candidate = s != -jnp.inf
    higher = higher_digits(key, last)
    item = candidate & (higher >= prefix)
    item_i = item.astype(jnp.int32)
    # Lanes not kept point past the row: masked on a GPU, dropped by
    # interpret mode's scatter (where they would otherwise rewrite a slot).
    at = jnp.where(item, c * chunk + count + _exclusive_cumsum(item_i), past_row)
    _scatter(item_id_ref, at, c * chunk + i * block + lane, item)
    _scatter(item_key_ref, at, key, item)
    group = candidate & (higher == prefix)
    return hist + digit_histogram(digit_of(key, last), group), count + jnp.sum(item_i)

  hist, count = lax.fori_loop(0, chunk // block, step, (jnp.zeros((HIST_ROWS, HIST_COLS), jnp.int32), jnp.int32(0)))
  count_ref[c] = count
  add_histogram(totals_ref, last, hist, interpret=interpret)
  ticket = arrive(totals_ref, tuple(jnp.int32(i) for i in _TICKET), interpret=interpret)

  @pl.when(ticket == chunks - 1)
  def _():
    key_t, ties, selected = _replay(totals_ref, DIGITS, topk)
    threshold = key_t ^ jnp.int32(_SIGN)  # signed: compares as the scores do
    chunk_ids = jnp.arange(next_pow2(chunks), dtype=jnp.int32)
    counts = _gather(count_ref, chunk_ids, chunk_ids < chunks)
    offsets = _exclusive_cumsum(counts)
    items = jnp.sum(counts)
    slot = jnp.arange(write_block, dtype=jnp.int32)

    def walk(carry):
      i, taken, tied = carry
      k = i * write_block + slot  # the row's k-th item
      present = k < items
      # Its chunk: the last whose offset is <= k (offsets never decrease).
      before = (offsets[None, :] <= k[:, None]) & (chunk_ids[None, :] < chunks)
      owner = jnp.sum(before.astype(jnp.int32), axis=1) - 1
      start = jnp.max(jnp.where(before, offsets[None, :], 0), axis=1)
      at = jnp.where(present, owner * chunk + k - start, 0)
      ids = _gather(item_id_ref, at, present)
      key = _gather(item_key_ref, at, present) ^ jnp.int32(_SIGN)
      tie = (present & (key == threshold)).astype(jnp.int32)
      tie_rank = tied + _exclusive_cumsum(tie)
      take = present & ((key > threshold) | ((tie == 1) & (tie_rank < ties)))
      take_i = take.astype(jnp.int32)
      pos = jnp.where(take, taken + _exclusive_cumsum(take_i), topk)
      _scatter(o_ref, pos, ids, take)
      return i + 1, taken + jnp.sum(take_i), tied + jnp.sum(tie)

    # Until every item is seen or every selected id is taken (a row of ties
    # stops after its first topk items).
    steps = (items + write_block - 1) // write_block
    lax.while_loop(
      lambda carry: (carry[0] < steps) & (carry[1] < selected), walk, (jnp.int32(0), jnp.int32(0), jnp.int32(0))
    )
    out_slot = jnp.arange(next_pow2(topk), dtype=jnp.int32)
    empty = (out_slot >= selected) & (out_slot < topk)
    _scatter(o_ref, jnp.where(empty, out_slot, topk), jnp.full(out_slot.shape, -1, jnp.int32), empty)


def _gather(ref, index: jax.Array, mask: jax.Array) -> jax.Array:
  """`ref[index]` where `mask`, 0 elsewhere (a masked gather)."""
  return plgpu.load(ref.at[index], mask=mask, other=0)


def _scatter(ref, index: jax.Array, values: jax.Array, mask: jax.Array) -> None:
  """`ref[index] = values` where `mask` (a masked scatter)."""
  plgpu.store(ref.at[index], values, mask=mask)


def count_first_digit(
  scores: jax.Array, totals: jax.Array, *, stage: SelectStage, name: str, interpret: bool
) -> jax.Array:
  """The first digit's histogram pass: `totals` with every row's candidates
  counted by their first digit."""
  batch = scores.shape[0]
  return common.pallas_call(
    functools.partial(_hist_kernel, block=stage.block_keys, digit=0, topk=1, interpret=interpret),
    out_shape=totals_shape(batch),
    grid=(batch, scores.shape[1] // stage.chunk_keys),
    in_specs=[pl.BlockSpec((None, stage.chunk_keys), lambda b, c: (b, c)), totals_spec()],
    out_specs=totals_spec(),
    input_output_aliases={1: 0},
    compiler_params=common.compiler_params(stage),
    interpret=interpret,
    name=f"{name}_hist0",
  )(scores, totals)


def select_topk(
  scores: jax.Array,
  *,
  topk: int,
  stage: SelectStage,
  totals: jax.Array | None = None,
  name: str = "radix_select",
  interpret: bool | None = None,
) -> jax.Array:
  """int32 `[B, topk]`: the ids of each row's `topk` best candidates (module
  docstring), increasing, -1 suffix.

  Args:
    scores: f32 `[B, W]`, -inf where an id is no candidate; W a multiple of
      `stage.chunk_keys` (`fit_stage` first), or any W when `totals` is None
      (padded with -inf here).
    topk: ids per row (static).
    stage: the passes' tiling (fitted: `fit_stage`).
    totals: the row totals (`totals_shape`, zeroed) holding the first
      digit's counts, added by the kernel that computed the scores
      (`add_histogram`); None: zeroed and counted by a pass here.
    name: prefix of the kernels' names (`<name>_hist<digit>`, `<name>_write`).
    interpret: None = interpret when no GPU is present.
  """
  batch, width = scores.shape
  if batch == 0:
    return jnp.zeros((0, topk), jnp.int32)
  interpret = resolve_interpret(interpret)
  padded = cdiv(max(width, 1), stage.chunk_keys) * stage.chunk_keys
  if padded != width:
    if totals is not None:
      raise ValueError(f"scores width {width} must be a multiple of chunk_keys={stage.chunk_keys}")
    scores = jnp.pad(scores, ((0, 0), (0, padded - width)), constant_values=-jnp.inf)
  chunks = padded // stage.chunk_keys
  if chunks > MAX_CHUNKS:
    raise ValueError(f"{chunks} chunks of {stage.chunk_keys} ids a row: at most {MAX_CHUNKS} (fit_stage)")
  if totals is None:
    totals = count_first_digit(
      scores, jnp.zeros(totals_shape(batch).shape, jnp.int32), stage=stage, name=name, interpret=interpret
    )
  scores_spec = pl.BlockSpec((None, stage.chunk_keys), lambda b, c: (b, c))
  params = common.compiler_params(stage)
  for digit in range(1, DIGITS - 1):
    totals = common.pallas_call(
      functools.partial(_hist_kernel, block=stage.block_keys, digit=digit, topk=topk, interpret=interpret),
      out_shape=totals_shape(batch),
      grid=(batch, chunks),
      in_specs=[scores_spec, totals_spec()],
      out_specs=totals_spec(),
      input_output_aliases={1: 0},
      compiler_params=params,
      interpret=interpret,
      name=f"{name}_hist{digit}",
    )(scores, totals)
  row = lambda n: pl.BlockSpec((None, n), lambda b, c: (b, 0))
  outputs = common.pallas_call(
    functools.partial(
      _write_kernel,
      block=stage.block_keys,
      write_block=stage.write_block,
      chunks=chunks,
      topk=topk,
      interpret=interpret,
    ),
    out_shape=(
      totals_shape(batch),
      jax.ShapeDtypeStruct((batch, padded), jnp.int32),
      jax.ShapeDtypeStruct((batch, padded), jnp.int32),
      jax.ShapeDtypeStruct((batch, chunks), jnp.int32),
      jax.ShapeDtypeStruct((batch, topk), jnp.int32),
    ),
    grid=(batch, chunks),
    in_specs=[scores_spec, totals_spec()],
    out_specs=(totals_spec(), row(padded), row(padded), row(chunks), row(topk)),
    input_output_aliases={1: 0},
    compiler_params=params,
    interpret=interpret,
    name=f"{name}_write",
  )(scores, totals)
  return outputs[-1]
