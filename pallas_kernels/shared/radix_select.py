"""Exact top-k of score rows by radix select, in Pallas: no sort.

For each row of f32 `scores [B, W]`, the ids of the `topk` largest scores
among the row's candidates (every score but -inf, which marks "no candidate"),
ties to the lower id, returned in increasing id order with a -1 suffix when a
row has fewer than `topk` candidates. Scores are ranked in the total order of
floats that XLA's TopK uses (-inf < ... < -0 < +0 < ... < +inf < NaN, every
NaN taken as +NaN whatever its sign bit), through their order key: the f32 bits as an unsigned integer with the sign bit
flipped for positives and every bit flipped for negatives.

The threshold T (the key of the `topk`-th best candidate) is found one 8-bit
digit of the key at a time, most significant first, as in a radix sort. All
passes have the grid `(B, chunks)` and read 4 bytes per id:

1. Digit histograms, one pass per digit: each program counts, for its chunk
   of the row, the candidates whose higher digits equal the prefix found so
   far, by their next digit: 256 bins as a 16 x 16 matrix, one tensor-core
   dot per step of two one-hot matrices (high and low nibble of the digit,
   int8 0/1, int32 counts), then adds them atomically to the row's totals
   `[B, 4, 16, 16]` (zeroed once, threaded through every pass). The first
   digit's counts can come from the kernel that computes the scores
   (`add_histogram` there), which saves a pass.
2. Each program of the next pass replays the choices from the totals of the
   digits before it (a few scans of 256 counts): a digit is the largest bin
   whose candidates with a digit at or above it reach the number still to
   select, r; r drops by the count strictly above it. So no glue runs
   between passes.
3. Write pass: after the fourth digit T is the full key and r the number of
   candidates equal to T to take (the lowest ids among them). The last
   histogram pass also writes, per chunk and bin, the candidates strictly
   above and equal to that bin; the write program of chunk c sums them at
   T's last digit over the chunks before c (the ids selected and the ties
   seen before it), then walks its chunk in id order, takes every candidate
   above T and the ties whose rank is below r, and stores each taken id at
   its output position (prefix sums within the step). The output is
   therefore already in increasing id order. The first chunk's program also
   writes the -1 suffix.

Launches: one zeroing of the totals, four histogram passes (three when the
first comes with the scores) and the write pass. Interpret mode: atomics
without masks only (SPEC 2), which is all this uses.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from pallas_kernels.shared import common
from pallas_kernels.shared.common import cdiv, next_pow2, resolve_interpret
from pallas_kernels.shared.fp_formats import f32_bits_one_nan
from pallas_kernels.shared.config_rules import DOT_BLOCK, NUM_STAGES, NUM_WARPS, KernelConfig, field, multiple_of

DIGIT_BITS = 8
DIGITS = 32 // DIGIT_BITS
NIBBLE = 16              # a digit's 256 bins as NIBBLE x NIBBLE (high, low)
BINS = NIBBLE * NIBBLE
_SIGN = -2 ** 31         # int32 with only the sign bit set


@dataclasses.dataclass(frozen=True)
class SelectStage(KernelConfig):
  """Tiling of the histogram and write passes: `block_keys` ids per step,
  `chunk_keys` ids per program."""
  block_keys: int = field(256, DOT_BLOCK)
  chunk_keys: int = field(1024, DOT_BLOCK, multiple_of("block_keys"))
  num_warps: int = field(4, NUM_WARPS)
  num_stages: int = field(2, NUM_STAGES)


def fit_stage(stage: SelectStage, width: int) -> SelectStage:
  """Shrinks the blocks to the row width (a short row: one small program)."""
  block = max(16, min(stage.block_keys, next_pow2(width)))
  return dataclasses.replace(stage, block_keys=block, chunk_keys=max(block, min(stage.chunk_keys, next_pow2(width))))


# ---------------------------------------------------------------------------
# Pieces shared by the kernels (also the kernel that computes the scores).

def order_key(scores: jax.Array) -> jax.Array:
  """int32 bits whose *unsigned* order is the total order of the f32 scores,
  every NaN counted as +NaN (the top of the order) whatever its sign bit."""
  bits = f32_bits_one_nan(scores)
  return bits ^ ((bits >> 31) | jnp.int32(_SIGN))


def digit_of(key: jax.Array, digit: int) -> jax.Array:
  """The `digit`-th 8-bit digit of an order key (0: the most significant)."""
  return lax.shift_right_logical(key, jnp.int32(32 - DIGIT_BITS * (digit + 1))) & (BINS - 1)


def digit_histogram(digits: jax.Array, counted: jax.Array) -> jax.Array:
  """int32 `[16, 16]` counts of `digits [n]` (0..255) where `counted`, by
  (high nibble, low nibble): one integer dot of two int8 one-hot matrices
  (int8 halves the operands' shared memory against bf16)."""
  bins = jnp.arange(NIBBLE, dtype=jnp.int32)
  high = ((digits[None, :] >> 4) == bins[:, None]) & counted[None, :]   # [16, n]
  low = (digits[:, None] & (NIBBLE - 1)) == bins[None, :]                # [n, 16]
  return jnp.dot(high.astype(jnp.int8), low.astype(jnp.int8), preferred_element_type=jnp.int32)


def totals_shape(batch: int) -> jax.ShapeDtypeStruct:
  """The running counts per row and digit, `[B, 4, 16, 16]` int32 (zeroed)."""
  return jax.ShapeDtypeStruct((batch, DIGITS, NIBBLE, NIBBLE), jnp.int32)


def totals_spec() -> pl.BlockSpec:
  """Every program of row b sees the row's totals (grids `(B, chunks)`)."""
  return pl.BlockSpec((None, DIGITS, NIBBLE, NIBBLE), lambda b, c: (b, 0, 0, 0))


def add_histogram(totals_ref, digit: int, hist: jax.Array) -> None:
  """Adds a chunk's `[16, 16]` counts of `digit` to the row's totals."""
  plgpu.atomic_add(totals_ref, (jnp.int32(digit), pl.ds(0, NIBBLE), pl.ds(0, NIBBLE)), hist)


def _total(x: jax.Array) -> jax.Array:
  return jnp.sum(jnp.sum(x, axis=1), axis=0)  # one axis at a time: lowers


def _exclusive_cumsum(x: jax.Array, axis: int = 0) -> jax.Array:
  return jnp.cumsum(x, axis=axis) - x


def _at_or_above(hist: jax.Array) -> jax.Array:
  """`[16, 16]`: per bin d = 16 h + l, the counts of the bins >= d."""
  rows = jnp.sum(hist, axis=1)
  rows_above = jnp.sum(rows) - jnp.cumsum(rows)                      # bins of the rows h' > h
  return rows_above[:, None] + rows[:, None] - _exclusive_cumsum(hist, axis=1)


def _boundary(hist: jax.Array, remaining: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(digit, r'): the bin holding the `remaining`-th best of the counted
  candidates, and how many to take from it."""
  at_or_above = _at_or_above(hist)
  digit = jnp.clip(_total((at_or_above >= remaining).astype(jnp.int32)) - 1, 0, BINS - 1)
  flat = (lax.broadcasted_iota(jnp.int32, hist.shape, 0) * NIBBLE + lax.broadcasted_iota(jnp.int32, hist.shape, 1))
  above = _total(jnp.where(flat == digit, at_or_above - hist, 0))
  return digit, remaining - above


def _replay(totals_ref, digits: int, topk: int):
  """(prefix, r, selected, last digit) after the first `digits` digits: the
  higher digits of T, the number still to select among the candidates with
  that prefix, and the number of ids the row selects."""
  selected = jnp.minimum(_total(totals_ref[0]), topk)
  prefix, remaining, digit = jnp.int32(0), selected, jnp.int32(0)
  for d in range(digits):
    digit, remaining = _boundary(totals_ref[d], remaining)
    prefix = (prefix << DIGIT_BITS) | digit
  return prefix, remaining, selected, digit


# ---------------------------------------------------------------------------
# Kernels.

def _hist_kernel(s_ref, totals_in_ref, totals_ref, *last_refs, block: int, digit: int, topk: int):
  # s_ref [chunk] f32; totals_in_ref / totals_ref [4, 16, 16] the row's counts
  # (aliased: read the digits before, add this one); with the last digit,
  # last_refs = (greater_ref, equal_ref) [16, 16]: this chunk's candidates
  # strictly above and equal to each bin.
  prefix = _replay(totals_in_ref, digit, topk)[0] if digit else jnp.int32(0)

  def step(i, carry):
    hist, above = carry
    s = s_ref[pl.ds(i * block, block)]
    key = order_key(s)
    counted = s != -jnp.inf
    if digit:
      higher = lax.shift_right_logical(key, jnp.int32(32 - DIGIT_BITS * digit))  # < 2**24: signed compares
      above = above + jnp.sum((counted & (higher > prefix)).astype(jnp.int32))
      counted = counted & (higher == prefix)
    return hist + digit_histogram(digit_of(key, digit), counted), above

  steps = s_ref.shape[0] // block
  hist, above = lax.fori_loop(0, steps, step, (jnp.zeros((NIBBLE, NIBBLE), jnp.int32), jnp.int32(0)))
  add_histogram(totals_ref, digit, hist)
  if last_refs:
    greater_ref, equal_ref = last_refs
    greater_ref[...] = above + _at_or_above(hist) - hist
    equal_ref[...] = hist


def _write_kernel(s_ref, totals_ref, greater_ref, equal_ref, o_ref, *, block: int, topk: int):
  # s_ref [chunk] f32; totals_ref [4, 16, 16]; greater_ref, equal_ref
  # [chunks_p, 16, 16] every chunk's (rows >= chunks unwritten, never read);
  # o_ref [topk_p] the row's ids.
  c = pl.program_id(1)
  chunk = s_ref.shape[0]
  key_t, ties, selected, digit = _replay(totals_ref, DIGITS, topk)
  threshold = key_t ^ jnp.int32(_SIGN)   # signed: compares as the scores do
  before = jnp.arange(greater_ref.shape[0], dtype=jnp.int32)
  at = (before, jnp.full(before.shape, digit >> 4), jnp.full(before.shape, digit & (NIBBLE - 1)))
  greater_before = jnp.sum(plgpu.load(greater_ref.at[at], mask=before < c, other=0))
  ties_before = jnp.sum(plgpu.load(equal_ref.at[at], mask=before < c, other=0))
  taken_before = greater_before + jnp.minimum(ties_before, ties)
  out_width = o_ref.shape[0]
  lane = jnp.arange(block, dtype=jnp.int32)

  def step(i, carry):
    taken, tied = carry
    s = s_ref[pl.ds(i * block, block)]
    key = order_key(s) ^ jnp.int32(_SIGN)
    candidate = s != -jnp.inf
    tie = (candidate & (key == threshold)).astype(jnp.int32)
    tie_rank = ties_before + tied + _exclusive_cumsum(tie)
    take = (candidate & (key > threshold)) | ((tie == 1) & (tie_rank < ties))
    take_i = take.astype(jnp.int32)
    pos = taken_before + taken + _exclusive_cumsum(take_i)
    # Lanes not taken point past the row: masked on a GPU, dropped by
    # interpret mode's scatter (where they would otherwise rewrite a slot).
    plgpu.store(o_ref.at[jnp.where(take, pos, out_width)], c * chunk + i * block + lane, mask=take)
    return taken + jnp.sum(take_i), tied + jnp.sum(tie)

  lax.fori_loop(0, chunk // block, step, (jnp.int32(0), jnp.int32(0)))

  @pl.when(c == 0)
  def _():
    slot = jnp.arange(out_width, dtype=jnp.int32)
    plgpu.store(o_ref.at[slot], jnp.full((out_width,), -1, jnp.int32), mask=slot >= selected)


def select_topk(scores: jax.Array, *, topk: int, stage: SelectStage, totals: jax.Array | None = None,
                name: str = "radix_select", interpret: bool | None = None) -> jax.Array:
  """int32 `[B, topk]`: the ids of each row's `topk` best candidates (module
  docstring), increasing, -1 suffix.

  Args:
    scores: f32 `[B, W]`, -inf where an id is no candidate; W a multiple of
      `stage.chunk_keys` (`fit_stage` first), or any W when `totals` is None
      (padded with -inf here).
    topk: ids per row (static).
    stage: the passes' tiling.
    totals: the row totals (`totals_shape`) holding the first digit's
      counts, added by the kernel that computed the scores
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
  first = 0 if totals is None else 1
  if totals is None:
    totals = jnp.zeros(totals_shape(batch).shape, jnp.int32)
  chunks = padded // stage.chunk_keys
  chunks_p = next_pow2(chunks)
  scores_spec = pl.BlockSpec((None, stage.chunk_keys), lambda b, c: (b, c))
  tile_spec = pl.BlockSpec((None, None, NIBBLE, NIBBLE), lambda b, c: (b, c, 0, 0))
  per_chunk = jax.ShapeDtypeStruct((batch, chunks_p, NIBBLE, NIBBLE), jnp.int32)
  params = plgpu.CompilerParams(num_warps=stage.num_warps, num_stages=stage.num_stages)
  for digit in range(first, DIGITS):
    last = digit == DIGITS - 1
    outputs = common.pallas_call(
        functools.partial(_hist_kernel, block=stage.block_keys, digit=digit, topk=topk),
        out_shape=(totals_shape(batch), *((per_chunk, per_chunk) if last else ())),
        grid=(batch, chunks),
        in_specs=[scores_spec, totals_spec()],
        out_specs=(totals_spec(), *((tile_spec, tile_spec) if last else ())),
        input_output_aliases={1: 0},
        compiler_params=params,
        interpret=interpret,
        name=f"{name}_hist{digit}",
    )(scores, totals)
    totals = outputs[0]
  _, greater, equal = outputs
  out_width = next_pow2(topk)
  whole = pl.BlockSpec((None, chunks_p, NIBBLE, NIBBLE), lambda b, c: (b, 0, 0, 0))
  ids = common.pallas_call(
      functools.partial(_write_kernel, block=stage.block_keys, topk=topk),
      out_shape=jax.ShapeDtypeStruct((batch, out_width), jnp.int32),
      grid=(batch, chunks),
      in_specs=[scores_spec, totals_spec(), whole, whole],
      out_specs=pl.BlockSpec((None, out_width), lambda b, c: (b, 0)),
      compiler_params=params,
      interpret=interpret,
      name=f"{name}_write",
  )(scores, totals, greater, equal)
  return ids if out_width == topk else ids[:, :topk]
