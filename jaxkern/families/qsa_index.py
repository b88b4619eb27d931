"""Qwen sparse attention (QSA) indexer decode (SPEC 4.11): the top-k block
selection `qsa_index_topk_decode_qwen38_h4_d128_topk512_c4`. Kernel:
`pallas_kernels.qsa_index`. The sparse attention over the selected blocks
(4.12) is `jaxkern.families.qsa_sparse_gqa`, which shares the paged input
synthesis below.

Input synthesis (SPEC 6), shared by both QSA definitions:
* Sequence lengths come from the record's `scheduler_sequence_lengths`
  (rescaled when the run's `MP` is smaller than the record's, keeping each
  length's residue mod 4 so tails and blockless sequences stay); from axes
  alone, the longest sequence fills exactly `MP` pages and the others are
  log-uniform below it. Either way the longest needs exactly `MP` pages.
* Pages: the cache has exactly `NP` pages. When the sequences need more than
  `NP` pages together, sequences share prefix pages with the longest one
  (each shares a share of its pages proportional to its length, as a common
  prompt prefix does), so that exactly `NP` distinct pages are used, as the
  records show (e.g. B=3, MP=554, NP=580). Physical ids are a random
  permutation; page-table entries past a sequence's pages are 0.
* The GQA definition's `topk_ids` come from the index definition itself:
  random indexer queries and compressed keys on the same page table (an
  index page of 16 compressed keys covers exactly one 64-token KV page) go
  through `qsa_index_topk_reference`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkern import compare, dispatch, roofline
from jaxkern.contract import Checks, public_op
from jaxkern.family import OpImpl, Precondition, in_range
from jaxkern.spmd import CONTRACTION, Split
from pallas_kernels.qsa_index import KERNELS

# Defaults of the constant axes the functions cannot read from input shapes
# (the selection width TOPK and the block size C); the registry passes each
# definition's own values (`axis_params` below).
TOPK = 512
COMPRESS = 4
INDEX_HEADS = 4  # indexer query heads (synthesis of topk_ids for 4.12)

# CPU scale: at most this many sequences and pages per sequence. 40 pages
# keep n > TOPK (640 blocks per index page table, 2560 tokens = 640 blocks per
# KV page table), so the selection stays a real choice.
_CPU_BATCH = 4
_CPU_PAGES = 40


# ---------------------------------------------------------------------------
# References (plain jnp, fp32).


def index_candidates(
  page_table: jax.Array, seq_lens: jax.Array, num_pages: int, page: int, compress: int = COMPRESS
) -> jax.Array:
  """bool `[B, MP * P]`: logical id j is a candidate of sequence b iff
  j < seq_lens[b] // compress (ids beyond the page table do not exist) and
  its page-table entry page_table[b, j // P] is a page, in [0, NP)."""
  j = jnp.arange(page_table.shape[1] * page)
  entry = page_table[:, j // page]
  return (j < (seq_lens // compress)[:, None]) & (entry >= 0) & (entry < num_pages)


def qsa_index_scores(
  q: jax.Array, index_k: jax.Array, page_table: jax.Array, seq_lens: jax.Array, *, compress: int = COMPRESS
) -> jax.Array:
  """score[b, j] = sum_h relu(q[b, h] . index_k[page_table[b, j // P], j % P]) / sqrt(D)
  for every candidate logical id j (`index_candidates`), -inf for the
  others, whose keys are never read. NaN scores are made one NaN (sign bit
  clear), which ranks first, as in the kernel. f32 `[B, MP * P]`; one
  sequence at a time (`[MP * P, D]` f32 keys)."""
  num_pages, page, _, head_dim = index_k.shape
  j = jnp.arange(page_table.shape[1] * page)
  candidates = index_candidates(page_table, seq_lens, num_pages, page, compress)

  def row(args):
    q_b, pages_b, ok_b = args
    keys = index_k[jnp.where(ok_b, pages_b[j // page], 0), j % page, 0].astype(jnp.float32)  # [width, D]
    dots = jnp.einsum("hd,jd->jh", q_b.astype(jnp.float32), keys, precision=lax.Precision.HIGHEST)
    score = jnp.sum(jnp.maximum(dots, 0.0), axis=-1) / math.sqrt(head_dim)
    score = jnp.where(jnp.isnan(score), jnp.nan, score)
    return jnp.where(ok_b, score, -jnp.inf)

  return lax.map(row, (q, page_table, candidates))


def qsa_index_topk_reference(
  q: jax.Array,
  index_k: jax.Array,
  page_table: jax.Array,
  seq_lens: jax.Array,
  *,
  topk: int = TOPK,
  compress: int = COMPRESS,
) -> jax.Array:
  """SPEC 4.11: the top-`topk` candidate ids (`index_candidates`) by
  `qsa_index_scores` (ties to the lower id: `lax.top_k` orders equal values
  by index; its total order ranks NaN first), sorted ascending with a -1
  suffix. int32 `[B, topk]`."""
  scores = qsa_index_scores(q, index_k, page_table, seq_lens, compress=compress)
  candidates = index_candidates(page_table, seq_lens, index_k.shape[0], index_k.shape[1], compress)
  if scores.shape[1] < topk:  # top_k needs at least topk candidates
    pad = ((0, 0), (0, topk - scores.shape[1]))
    scores = jnp.pad(scores, pad, constant_values=-jnp.inf)
    candidates = jnp.pad(candidates, pad, constant_values=False)
  _, ids = lax.top_k(scores, topk)
  last = jnp.iinfo(jnp.int32).max  # sorts -1 slots after every real id
  ids = jnp.sort(jnp.where(jnp.take_along_axis(candidates, ids, axis=1), ids, last).astype(jnp.int32), axis=1)
  return jnp.where(ids == last, -1, ids)


def index_topk_scores(inputs: Mapping[str, jax.Array]) -> jax.Array:
  """What 4.11 ranks, per logical id: f32 `[B, MP * P]`, -inf beyond n (for the
  tie-aware comparison of SPEC 5). Policies see only the inputs, so C is the
  Qwen3.8 value here."""
  return qsa_index_scores(inputs["q"], inputs["index_k"], inputs["page_table"], inputs["seq_lens"])


# ---------------------------------------------------------------------------
# Input synthesis.


def _numpy_rng(key: jax.Array) -> np.random.Generator:
  return np.random.default_rng(np.asarray(jax.random.key_data(key)).astype(np.uint32).tolist())


class Paging:
  """How tokens map to pages: `page` entries per page, each entry covering
  `per_entry` tokens (4.11: 16 compressed keys of C tokens; 4.12: 64 tokens
  of 1), where only complete C-token blocks get a compressed key."""

  def __init__(self, page: int, compress: int, index: bool):
    self.page, self.compress, self.index = page, compress, index

  def pages(self, lengths):
    entries = lengths // self.compress if self.index else lengths
    return -(-entries // self.page)

  def length_range(self, max_pages: int) -> tuple[int, int]:
    """The lengths whose page count is exactly `max_pages` (>= 1)."""
    if self.index:  # complete blocks only; up to C - 1 tail tokens extra
      return (self.compress * (self.page * (max_pages - 1) + 1), self.compress * (self.page * max_pages + 1) - 1)
    return self.page * (max_pages - 1) + 1, self.page * max_pages

  def clip(self, x, lo: int, hi: int):
    """Clips into [lo, hi] (at least C wide) keeping x mod C (the tail)."""
    c = self.compress
    r = x % c
    x = np.clip(x, lo, hi)
    x = x - (x - r) % c
    return np.where(x < lo, x + c, x)


def sequence_lengths(
  batch: int, max_pages: int, rng: np.random.Generator, record: dict | None, paging: Paging
) -> np.ndarray:
  """int64 `[B]` token counts whose longest needs exactly `max_pages` pages.

  From `record["scheduler_sequence_lengths"]` when present: the first B
  (cycled when the record has fewer), rescaled by MP / (the record's pages)
  when those differ, each keeping its residue mod C. Otherwise the longest is
  drawn among the lengths filling `max_pages` and the rest log-uniformly in
  [1, longest]."""
  lo, hi = paging.length_range(max_pages)
  c = paging.compress
  recorded = (record or {}).get("scheduler_sequence_lengths")
  if recorded:
    lengths = np.resize(np.asarray(recorded, np.int64), batch)
    rec_pages = int(paging.pages(lengths).max())
    if rec_pages != max_pages and rec_pages > 0:
      scaled = np.floor(lengths * (max_pages / rec_pages)).astype(np.int64)
      lengths = np.maximum(scaled // c * c + lengths % c, 1)
  else:
    longest = int(rng.integers(lo, hi + 1))
    lengths = np.exp(rng.uniform(0.0, np.log(longest), batch)).astype(np.int64)
    lengths[int(rng.integers(batch))] = longest
  lengths = paging.clip(lengths, 1, hi)
  i = int(np.argmax(lengths))
  lengths[i] = paging.clip(lengths[i], lo, hi)
  return lengths


def shared_prefix_page_table(pages: np.ndarray, max_pages: int, num_pages: int, rng: np.random.Generator) -> np.ndarray:
  """int32 `[B, MP]` page table over exactly `num_pages` physical pages.

  Sequence i needs `pages[i]` pages. When they need more than `num_pages`
  together, sequences share the first pages of the longest one (prefix
  sharing), proportionally to their own page counts, so that exactly
  `num_pages` distinct pages are used; otherwise all pages are private and
  the surplus pages are allocated but unreferenced. Needs
  `max(pages) <= min(max_pages, num_pages)`."""
  batch = len(pages)
  donor = int(np.argmax(pages))
  if pages[donor] > min(max_pages, num_pages):
    raise ValueError(f"a sequence needs {pages[donor]} pages; MP={max_pages}, NP={num_pages}")
  others = np.array([i for i in range(batch) if i != donor], np.int64)
  shared = np.zeros(batch, np.int64)
  excess = int(pages.sum()) - num_pages
  if excess > 0:
    cap = pages[others]  # a sequence shares at most all of its pages
    share = np.floor(excess * cap / cap.sum()).astype(np.int64)
    for j in np.argsort(-(cap - share), kind="stable"):  # hand out the rounding remainder
      if share.sum() == excess:
        break
      share[j] += min(cap[j] - share[j], excess - share.sum())
    shared[others] = share
  perm = rng.permutation(num_pages).astype(np.int32)
  table = np.zeros((batch, max_pages), np.int32)
  table[donor, : pages[donor]] = perm[: pages[donor]]
  used = int(pages[donor])
  for i in others:
    s, p = int(shared[i]), int(pages[i])
    table[i, :s] = table[donor, :s]
    table[i, s:p] = perm[used : used + p - s]
    used += p - s
  return table


def paged_structure(axes: Mapping[str, int], key: jax.Array, record: dict | None, *, index: bool):
  """(page_table int32 [B, MP], seq_lens int32 [B]) for `axes` (see the
  module docstring); `index` selects 4.11's paging (P compressed keys of C
  tokens per page) over 4.12's (P tokens per page)."""
  rng = _numpy_rng(key)
  batch, max_pages, num_pages = int(axes["B"]), int(axes["MP"]), int(axes["NP"])
  paging = Paging(int(axes["P"]), int(axes["C"]), index)
  lengths = sequence_lengths(batch, max_pages, rng, record, paging)
  table = shared_prefix_page_table(paging.pages(lengths), max_pages, num_pages, rng)
  return jnp.asarray(table), jnp.asarray(lengths.astype(np.int32))


def make_index_inputs(axes: Mapping[str, int], key: jax.Array, record: dict | None = None) -> dict[str, jax.Array]:
  """4.11 inputs: bf16 N(0, 1) queries and compressed keys (scores then spread
  like a trained indexer's, with exact zeros where every head's dot is
  negative, about 1 key in 16), page table and lengths as in the module
  docstring."""
  key_struct, key_q, key_k = jax.random.split(key, 3)
  page_table, seq_lens = paged_structure(axes, key_struct, record, index=True)
  b, h, d = int(axes["B"]), int(axes["H"]), int(axes["D"])
  shape_k = (int(axes["NP"]), int(axes["P"]), int(axes["HKV"]), d)
  return {
    "q": jax.random.normal(key_q, (b, h, d), jnp.bfloat16),
    "index_k": jax.random.normal(key_k, shape_k, jnp.bfloat16),
    "page_table": page_table,
    "seq_lens": seq_lens,
  }


def cpu_axes(axes: Mapping[str, int]) -> dict[str, int]:
  """At most 4 sequences of at most 40 pages (n up to 640 > TOPK blocks);
  NP shrunk in proportion to B * MP (so prefix sharing stays) and >= MP.
  Constants kept."""
  out = dict(axes)
  batch, max_pages, num_pages = int(axes["B"]), int(axes["MP"]), int(axes["NP"])
  out["B"] = min(batch, _CPU_BATCH)
  out["MP"] = min(max_pages, _CPU_PAGES)
  ratio = (out["B"] * out["MP"]) / (batch * max_pages)
  out["NP"] = max(out["MP"], min(num_pages, round(num_pages * ratio)))
  return out


# ---------------------------------------------------------------------------
# Roofline cost (`OpImpl.cost`, see `jaxkern.roofline`).


def referenced_pages(page_table: np.ndarray, entries: np.ndarray, per_page: int, num_pages: int) -> np.ndarray:
  """The distinct physical pages in [0, num_pages) that hold the first
  `entries[b]` entries of each sequence b (per_page entries a page)."""
  used = np.arange(page_table.shape[1])[None, :] < -(-np.asarray(entries)[:, None] // per_page)
  pages = page_table[used]
  return np.unique(pages[(pages >= 0) & (pages < num_pages)])


def qsa_index_topk_cost(definition, axes, *, inputs=None, record=None, config=None):
  """QSA indexer: every sequence scores its n = seq_len // C compressed keys
  (at most the page table's MP P) through its page table: FLOPs 2 H D per
  scored key (relu and the head sum are not counted). With the run's
  `seq_lens` and `page_table` n is exact and index_k counts only the
  distinct pages those keys live on (`referenced_pages`: shared prefix pages
  read once); without them every sequence scores MP P keys and
  min(NP, B MP) pages are read (bounds). Top-k: the selection's comparisons
  are not FLOPs and the scores stay on chip; only the ids [B, TOPK] are
  written. q, page_table, seq_lens read once."""
  page = roofline.tensor_bytes(definition, "index_k", axes) // max(axes["NP"], 1)
  width = axes["MP"] * axes["P"]
  if inputs is None or inputs.get("seq_lens") is None or inputs.get("page_table") is None:
    keys, pages, source = axes["B"] * width, min(axes["NP"], axes["B"] * axes["MP"]), "axes"
  else:
    n = np.clip(roofline.host(inputs["seq_lens"]).astype(np.int64) // axes["C"], 0, width)
    keys, source = int(n.sum()), "inputs"
    pages = referenced_pages(roofline.host(inputs["page_table"]), n, axes["P"], axes["NP"]).size
  flops = 2 * keys * axes["H"] * axes["D"]
  return roofline.Work(
    flops, roofline.io_bytes(definition, axes, skip=("index_k",)) + pages * page, "bf16", counted_from=source
  )


def page_table_precondition(
  page_table: jax.Array, tokens_per_entry: jax.Array, tokens_per_page: int, num_pages: int
) -> Precondition:
  """The page-table entries a sequence uses (the first ceil(tokens / tokens
  per page)) must be pages, in [0, NP); later entries are never read."""
  used = -(-tokens_per_entry // tokens_per_page)
  col = jnp.arange(page_table.shape[1])
  return Precondition(
    "page_table",
    (col[None, :] >= used[:, None]) | in_range(page_table, 0, num_pages),
    f"[0, NP) with NP = {num_pages} in the entries a sequence uses (the first ceil(its tokens / {tokens_per_page}))",
  )


def index_preconditions(inputs: Mapping[str, jax.Array], *, compress: int = COMPRESS) -> list[Precondition]:
  """Checked mode: seq_lens within the page table, the entries they use pages."""
  page_table, seq_lens = inputs["page_table"], inputs["seq_lens"]
  num_pages, page = inputs["index_k"].shape[:2]
  capacity = (page_table.shape[1] * page + 1) * compress  # tokens: whole blocks + a tail
  return [
    Precondition(
      "seq_lens",
      in_range(seq_lens, 0, capacity),
      f"[0, (MP*P + 1)*C) = [0, {capacity}) tokens (the page table holds "
      f"{page_table.shape[1]}*{page} blocks of C = {compress} tokens)",
    ),
    page_table_precondition(page_table, seq_lens // compress, page, num_pages),
  ]


# Keyword-only parameters that receive the definition's constant axes.
AXIS_PARAMS = {"topk": "TOPK", "compress": "C"}

# How the op splits across devices (`jaxkern.spmd`): sequences (with their
# page tables); a score sums over the heads, page tables address every page.
SPLIT = Split(
  inputs={"q": "b h d", "index_k": "np ps o d", "page_table": "b mp", "seq_lens": "b"},
  outputs=("b k",),
  independent="b",
  reasons={"h": "a block's score sums over the heads", "np": "page tables address the whole cache", "d": CONTRACTION},
)
IMPL = OpImpl(
  reference=qsa_index_topk_reference,
  kernels=KERNELS,
  make_inputs=make_index_inputs,
  cpu_axes=cpu_axes,
  cost=qsa_index_topk_cost,
  policies={"topk_ids": compare.TopK(scores=index_topk_scores)},
  axis_params=AXIS_PARAMS,
  split=SPLIT,
  preconditions=index_preconditions,
)
IMPLS = (IMPL,)


# ---------------------------------------------------------------------------
# Public op (`jaxkern.ops`), dispatched by `jaxkern.dispatch`.


def check_paging(c: Checks, batch: int, page_table, seq_lens) -> None:
  """page_table [B, MP] and seq_lens [B], integers (both QSA ops)."""
  c.rank("page_table", page_table, "[B, MP]", 2)
  c.shape("page_table", page_table, (batch, None), "[B, MP]", "B from q")
  c.shape("seq_lens", seq_lens, (batch,), "[B]", "B from q")
  c.integer("page_table", page_table)
  c.integer("seq_lens", seq_lens)


def validate(q, index_k, page_table, seq_lens, **_) -> None:
  """The contract of `qsa_index_topk` (`jaxkern.contract`): q [B, HQ, D],
  one-head paged keys [NP, P, 1, D] in q's float dtype, integer paging."""
  c = Checks("qsa_index_topk")
  c.rank("q", q, "[B, HQ, D]", 3)
  c.shape("index_k", index_k, (None, None, 1, q.shape[2]), "[NP, P, 1, D]", "one key head, D from q")
  check_paging(c, q.shape[0], page_table, seq_lens)
  c.floating("q", q)
  c.same_dtype("index_k", index_k, "q", q)


@public_op(validate)
def qsa_index_topk(
  q: jax.Array,
  index_k: jax.Array,
  page_table: jax.Array,
  seq_lens: jax.Array,
  *,
  config: Any = None,
  backend: dispatch.Backend = None,
  checks: bool = False,
) -> jax.Array:
  """QSA indexer: q [B, 4, 128] bf16, paged compressed keys index_k
  [NP, 16, 1, 128] bf16, page_table [B, MP] int32, seq_lens [B] int32 tokens
  -> int32 [B, 512] top-512 block ids (block = 4 tokens) by
  `sum_h relu(q_h . k) / sqrt(128)`, ascending, -1 suffix.

  Contract (P = 16 keys per page, C = 4 tokens per block):
  * B >= 0. Block j < n = seq_lens[b] // C of sequence b is the key
    index_k[page_table[b, j // P], j % P]; blocks are the candidates.
  * seq_lens valid: `[0, (MP*P + 1)*C)`, i.e. `n <= MP*P` (the table's blocks;
    a tail of fewer than C tokens has no block). page_table valid: the
    entries the sequence uses (the first ceil(n / P)) in [0, NP); later
    entries are never read.
  * Outside (`checks=True` reports the first offending value instead):
    a longer sequence is cut to the table (ids beyond `MP*P` do not exist);
    a negative length has no blocks; blocks on an entry outside [0, NP)
    are not candidates. The selection is then the top-512 candidates (ties
    to the lower id), fewer when there are fewer, -1 suffixed.
  * NaN scores (NaN in q or in a candidate's key) rank above every number
    (`lax.top_k`'s order); keys of non-candidates are never read.
  Cost on the kernel path: none; the checks are selects inside the kernels.

  Backends: `xla`, `triton`."""
  inputs = {"q": q, "index_k": index_k, "page_table": page_table, "seq_lens": seq_lens}
  return dispatch.run(IMPL, inputs, config=config, backend=backend, checks=checks)
