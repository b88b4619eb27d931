"""Qwen sparse attention (QSA) sparse GQA decode (SPEC 4.12):
`qsa_sparse_gqa_decode_qwen38_h24_kv2_d256_topk512_c4`, attention over the
4-token blocks the indexer selected plus the incomplete tail. Kernel:
`pallas_kernels.qsa_sparse_gqa`. Paged inputs are synthesized as the
indexer's (`jaxkern.families.qsa_index`), and `topk_ids` come from the
indexer's reference on the same page table.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkern import dispatch, roofline
from jaxkern.contract import Checks, public_op
from jaxkern.families.qsa_index import (
  AXIS_PARAMS,
  COMPRESS,
  INDEX_HEADS,
  check_paging,
  cpu_axes,
  page_table_precondition,
  paged_structure,
  qsa_index_topk_reference,
)
from jaxkern.family import OpImpl, Precondition, in_range
from jaxkern.spmd import CONTRACTION, Split
from pallas_kernels.qsa_sparse_gqa import KERNELS


def qsa_sparse_gqa_decode_reference(
  q: jax.Array,
  k_cache: jax.Array,
  v_cache: jax.Array,
  page_table: jax.Array,
  seq_lens: jax.Array,
  topk_ids: jax.Array,
  sm_scale: jax.Array,
  *,
  compress: int = COMPRESS,
) -> jax.Array:
  """SPEC 4.12: softmax attention of q over the visible tokens: t < seq_len
  with t // C among topk_ids, plus the tail t >= C * (seq_len // C) (C =
  `compress`, 4). Query head h reads kv head h // (HQ / HKV). fp32, rounded
  once; 0 when nothing is visible. One sequence at a time over its
  (TOPK + 1) * C candidate
  tokens (each listed block's C tokens and the tail block's).

  Outside the contract (`qsa_sparse_gqa_decode`): seq_len is cut to the
  page table's MP * P tokens; a token whose page-table entry is outside
  [0, NP) is not visible. Tokens that are not visible are selected away
  (`where` on scores, keys and values), never multiplied by zero."""
  batch, q_heads, head_dim = q.shape
  num_pages, page, kv_heads, _ = k_cache.shape
  group = q_heads // kv_heads
  lane = jnp.arange(compress)

  def row(args):
    q_b, pages_b, len_b, ids_b = args
    len_b = jnp.minimum(len_b, pages_b.shape[0] * page)
    n = len_b // compress
    # A listed id >= n has no token below seq_len outside the tail, which is
    # added anyway; a repeated id counts once (a set of blocks).
    ids_b = jnp.sort(jnp.where((ids_b >= 0) & (ids_b < n), ids_b, -1))
    ids_b = jnp.where(jnp.concatenate([jnp.array([False]), ids_b[1:] == ids_b[:-1]]), -1, ids_b)
    blocks = jnp.concatenate([ids_b, n[None]])  # [TOPK + 1]
    t = (blocks[:, None] * compress + lane).reshape(-1)  # candidate tokens
    visible = (jnp.repeat(blocks, compress) >= 0) & (t < len_b)
    t = jnp.where(visible, t, 0)
    phys = pages_b[t // page]
    visible &= (phys >= 0) & (phys < num_pages)
    phys, t = jnp.where(visible, phys, 0), jnp.where(visible, t, 0)
    hidden = ~visible[:, None, None]
    k = jnp.where(hidden, 0.0, k_cache[phys, t % page].astype(jnp.float32))  # [T, HKV, D]
    v = jnp.where(hidden, 0.0, v_cache[phys, t % page].astype(jnp.float32))
    qg = q_b.astype(jnp.float32).reshape(kv_heads, group, head_dim)
    s = jnp.einsum("gid,tgd->git", qg, k, precision=lax.Precision.HIGHEST) * sm_scale
    s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("git,tgd->gid", p, v, precision=lax.Precision.HIGHEST)
    o = o * jnp.where(l > 0.0, 1.0 / l, 0.0)
    return o.reshape(q_heads, head_dim).astype(q.dtype)

  return lax.map(row, (q, page_table, seq_lens.astype(jnp.int32), topk_ids.astype(jnp.int32)))


def preconditions(inputs: Mapping[str, jax.Array], *, compress: int = COMPRESS) -> list[Precondition]:
  """Checked mode: seq_lens within the page table, the entries they use
  pages, topk_ids -1 or blocks of their sequence."""
  page_table, seq_lens, ids = inputs["page_table"], inputs["seq_lens"], inputs["topk_ids"]
  num_pages, page = inputs["k_cache"].shape[:2]
  capacity = page_table.shape[1] * page
  blocks = (seq_lens // compress)[:, None]
  return [
    Precondition(
      "seq_lens",
      in_range(seq_lens, 0, capacity + 1),
      f"[0, MP*P] = [0, {capacity}] tokens (the page table's {page_table.shape[1]} pages of {page})",
    ),
    page_table_precondition(page_table, seq_lens, page, num_pages),
    Precondition(
      "topk_ids",
      (ids == -1) | in_range(ids, 0, blocks),
      f"-1 (empty slot) or a block of the sequence, [0, seq_lens[b] // {compress})",
    ),
  ]


def make_gqa_inputs(axes: Mapping[str, int], key: jax.Array, record: dict | None = None) -> dict[str, jax.Array]:
  """4.12 inputs: bf16 N(0, 1) q, K and V (scores q.k * D^-0.5 ~ N(0, 1)),
  sm_scale = D^-0.5, page table and lengths as in the module docstring, and
  topk_ids from `qsa_index_topk_reference` on synthetic indexer inputs over
  the same page table."""
  key_struct, key_q, key_k, key_v, key_iq, key_ik = jax.random.split(key, 6)
  page_table, seq_lens = paged_structure(axes, key_struct, record, index=False)
  b, hq, d = int(axes["B"]), int(axes["HQ"]), int(axes["D"])
  num_pages, page, kv_heads = int(axes["NP"]), int(axes["P"]), int(axes["HKV"])
  index_page = page // int(axes["C"])  # compressed keys per KV page
  index_q = jax.random.normal(key_iq, (b, INDEX_HEADS, 128), jnp.bfloat16)
  index_k = jax.random.normal(key_ik, (num_pages, index_page, 1, 128), jnp.bfloat16)
  select = jax.jit(functools.partial(qsa_index_topk_reference, topk=int(axes["TOPK"]), compress=int(axes["C"])))
  topk_ids = select(index_q, index_k, page_table, seq_lens)
  cache_shape = (num_pages, page, kv_heads, d)
  return {
    "q": jax.random.normal(key_q, (b, hq, d), jnp.bfloat16),
    "k_cache": jax.random.normal(key_k, cache_shape, jnp.bfloat16),
    "v_cache": jax.random.normal(key_v, cache_shape, jnp.bfloat16),
    "page_table": page_table,
    "seq_lens": seq_lens,
    "topk_ids": topk_ids,
    "sm_scale": jnp.asarray(d**-0.5, jnp.float32),
  }


# ---------------------------------------------------------------------------
# Roofline cost (`OpImpl.cost`, see `jaxkern.roofline`).


def visible_tokens(seq_len: int, ids: np.ndarray, compress: int) -> np.ndarray:
  """The logical tokens one sequence attends to (SPEC 4.12): every token of
  the selected complete blocks (ids in [0, n), n = seq_len // C, each
  counted once) and the incomplete tail n C .. seq_len - 1."""
  n = seq_len // compress
  blocks = np.unique(ids[(ids >= 0) & (ids < n)])
  selected = (blocks[:, None] * compress + np.arange(compress)).reshape(-1)
  return np.concatenate([selected, np.arange(n * compress, seq_len)])


def qsa_sparse_gqa_decode_cost(definition, axes, *, inputs=None, record=None, config=None):
  """QSA sparse GQA decode: FLOPs 4 HQ D per visible token (`visible_tokens`:
  the selected blocks' tokens and the tail, at most the page table's MP P
  tokens), summed over sequences; of k_cache and v_cache only the distinct
  physical token rows (all HKV heads of a token) some sequence reads; the
  gather floor is every visible token's row once per sequence. Counted
  from the run's `seq_lens`, `topk_ids` and `page_table`; without them each
  sequence sees t = min(MP P, TOPK C + C - 1) tokens and min(B t, NP P)
  distinct rows are read (bounds). q, page_table, seq_lens, topk_ids and the
  scalar read, o written once."""
  tokens = axes["NP"] * axes["P"]
  row = (
    roofline.tensor_bytes(definition, "k_cache", axes) + roofline.tensor_bytes(definition, "v_cache", axes)
  ) // max(tokens, 1)
  capacity = axes["MP"] * axes["P"]
  names = ("seq_lens", "topk_ids", "page_table")
  if inputs is None or any(inputs.get(n) is None for n in names):
    t = min(capacity, axes["TOPK"] * axes["C"] + axes["C"] - 1)
    seen, distinct, source = axes["B"] * t, min(axes["B"] * t, tokens), "axes"
  else:
    seq_lens, topk_ids, table = (roofline.host(inputs[n]) for n in names)
    rows = []
    for b in range(seq_lens.shape[0]):
      t = visible_tokens(int(np.clip(seq_lens[b], 0, capacity)), topk_ids[b], axes["C"])
      page = table[b, t // axes["P"]]
      ok = (page >= 0) & (page < axes["NP"])
      rows.append(page[ok].astype(np.int64) * axes["P"] + t[ok] % axes["P"])
    rows = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    seen, distinct, source = rows.size, np.unique(rows).size, "inputs"
  nbytes = roofline.io_bytes(definition, axes, skip=("k_cache", "v_cache")) + distinct * row
  return roofline.Work(4 * axes["HQ"] * axes["D"] * seen, nbytes, "bf16", gather_bytes=seen * row, counted_from=source)


# How the op splits across devices (`jaxkern.spmd`): sequences and heads (q
# heads with the kv head they read: q head h reads kv head h // (HQ/HKV)).
SPLIT = Split(
  inputs={
    "q": "b h d",
    "k_cache": "np ps h d",
    "v_cache": "np ps h d",
    "page_table": "b mp",
    "seq_lens": "b",
    "topk_ids": "b k",
    "sm_scale": "",
  },
  outputs=("b h d",),
  independent="b h",
  reasons={"np": "page tables address the whole cache", "d": CONTRACTION},
)
IMPL = OpImpl(
  reference=qsa_sparse_gqa_decode_reference,
  kernels=KERNELS,
  make_inputs=make_gqa_inputs,
  cpu_axes=cpu_axes,
  cost=qsa_sparse_gqa_decode_cost,
  axis_params=AXIS_PARAMS,
  split=SPLIT,
  preconditions=preconditions,
)
IMPLS = (IMPL,)


# ---------------------------------------------------------------------------
# Public op (`jaxkern.ops`), dispatched by `jaxkern.dispatch`.


def validate(q, k_cache, v_cache, page_table, seq_lens, topk_ids, *, sm_scale=None, **_) -> None:
  """The contract of `qsa_sparse_gqa_decode` (`jaxkern.contract`): q
  [B, HQ, D], paged caches [NP, P, HKV, D] (HQ a multiple of HKV) in q's
  float dtype, integer paging and topk_ids [B, TOPK >= 1]."""
  c = Checks("qsa_sparse_gqa_decode")
  c.rank("q", q, "[B, HQ, D]", 3)
  batch, heads, head_dim = q.shape
  c.shape("k_cache", k_cache, (None, None, None, head_dim), "[NP, P, HKV, D]", "D from q")
  kv_heads = k_cache.shape[2]
  if kv_heads == 0 or heads % kv_heads:
    c.fail("k_cache", f"[NP, P, HKV, D] with HQ = {heads} (q.shape[1]) a multiple of HKV", f"shape {k_cache.shape}")
  c.shape("v_cache", v_cache, k_cache.shape, "[NP, P, HKV, D]", "k_cache's shape")
  check_paging(c, batch, page_table, seq_lens)
  c.rank("topk_ids", topk_ids, "[B, TOPK]", 2)
  if topk_ids.shape[0] != batch or topk_ids.shape[1] < 1:
    c.fail("topk_ids", f"[B, TOPK] with B = {batch} (from q) and TOPK >= 1", f"shape {topk_ids.shape}")
  c.floating("q", q)
  c.same_dtype("k_cache", k_cache, "q", q)
  c.same_dtype("v_cache", v_cache, "q", q)
  c.integer("topk_ids", topk_ids)
  c.scalar("sm_scale", sm_scale, optional=True)


@public_op(validate, was_positional=("sm_scale",))
def qsa_sparse_gqa_decode(
  q: jax.Array,
  k_cache: jax.Array,
  v_cache: jax.Array,
  page_table: jax.Array,
  seq_lens: jax.Array,
  topk_ids: jax.Array,
  *,
  sm_scale: float | jax.Array | None = None,
  config: Any = None,
  backend: dispatch.Backend = None,
  checks: bool = False,
) -> jax.Array:
  """QSA sparse decode: q [B, 24, 256] bf16 over the 4-token blocks in topk_ids
  [B, 512] int32 (-1 = empty) plus the incomplete tail, paged k/v_cache
  [NP, 64, 2, 256] bf16 (page_table [B, MP] and seq_lens [B] int32); GQA (12 q heads per kv head); sm_scale defaults to
  256**-0.5 (a traced scalar works). Returns [B, 24, 256] in q's dtype.

  Contract (P = 64 tokens per page, C = 4 tokens per block):
  * B >= 0; HQ a multiple of HKV. Token t of sequence b is
    k/v_cache[page_table[b, t // P], t % P]; it is visible when t < seq_lens[b]
    and its block t // C is listed in topk_ids[b] or is the incomplete tail.
  * seq_lens valid: `[0, MP*P]`; page_table valid: the entries the sequence
    uses (the first ceil(seq_lens[b] / P)) in [0, NP), later entries never
    read; topk_ids valid: -1 (empty slot) or [0, seq_lens[b] // C), in any
    order, a block listed twice counting once.
  * Outside (`checks=True` reports the first offending value instead): a
    longer sequence is cut to the table's `MP*P` tokens; listed ids outside
    the sequence's blocks add nothing; a token on an entry outside
    [0, NP) is not visible. A token that is not visible never reaches the
    output (NaN there changes nothing); no visible token gives 0.
  Cost on the kernel path: one small XLA sort of [B, 513] ids (the
  dedupe, one launch); the rest are selects inside the kernel.

  Backends: `xla`, `triton`."""
  sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
  inputs = {
    "q": q,
    "k_cache": k_cache,
    "v_cache": v_cache,
    "page_table": page_table,
    "seq_lens": seq_lens,
    "topk_ids": topk_ids,
    "sm_scale": jnp.asarray(sm_scale, jnp.float32),
  }
  return dispatch.run(IMPL, inputs, config=config, backend=backend, checks=checks)
