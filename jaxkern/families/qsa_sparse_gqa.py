"""Qwen sparse attention (QSA) sparse GQA decode (SPEC 4.12):
`qsa_sparse_gqa_decode_qwen38_h24_kv2_d256_topk512_c4`, attention over the
4-token blocks the indexer selected plus the incomplete tail. Kernel:
`pallas_kernels.qsa_sparse_gqa`. Paged inputs are synthesized as the
indexer's (`jaxkern.families.qsa_index`), and `topk_ids` come from the
indexer's reference on the same page table.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import jax
from jax import lax
import jax.numpy as jnp

from jaxkern import dispatch
from jaxkern import roofline
from jaxkern.families.qsa_index import (AXIS_PARAMS, COMPRESS, INDEX_HEADS, cpu_axes, paged_structure,
                                        qsa_index_topk_reference)
from jaxkern.family import OpImpl
from jaxkern.spmd import CONTRACTION, Split
from pallas_kernels import qsa_sparse_gqa as gqa_lib


def qsa_sparse_gqa_decode_reference(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                                    page_table: jax.Array, seq_lens: jax.Array, topk_ids: jax.Array,
                                    sm_scale: jax.Array, *, compress: int = COMPRESS) -> jax.Array:
  """SPEC 4.12: softmax attention of q over the visible tokens: t < seq_len
  with t // C among topk_ids, plus the tail t >= C * (seq_len // C) (C =
  `compress`, 4). Query head h reads kv head h // (HQ / HKV). fp32, rounded
  once; 0 when nothing is visible. One sequence at a time over its
  (TOPK + 1) * C candidate
  tokens (each listed block's C tokens and the tail block's)."""
  batch, q_heads, head_dim = q.shape
  _, page, kv_heads, _ = k_cache.shape
  group = q_heads // kv_heads
  lane = jnp.arange(compress)

  def row(args):
    q_b, pages_b, len_b, ids_b = args
    n = len_b // compress
    # A listed id >= n has no token below seq_len outside the tail, which is
    # added anyway; a repeated id counts once (a set of blocks).
    ids_b = jnp.sort(jnp.where((ids_b >= 0) & (ids_b < n), ids_b, -1))
    ids_b = jnp.where(jnp.concatenate([jnp.array([False]), ids_b[1:] == ids_b[:-1]]), -1, ids_b)
    blocks = jnp.concatenate([ids_b, n[None]])                    # [TOPK + 1]
    t = (blocks[:, None] * compress + lane).reshape(-1)          # candidate tokens
    visible = (jnp.repeat(blocks, compress) >= 0) & (t < len_b)
    t = jnp.where(visible, t, 0)
    phys = pages_b[t // page]
    k = k_cache[phys, t % page].astype(jnp.float32)              # [T, HKV, D]
    v = v_cache[phys, t % page].astype(jnp.float32)
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


def make_gqa_inputs(axes: Mapping[str, int], key: jax.Array,
                    record: dict | None = None) -> dict[str, jax.Array]:
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
  select = jax.jit(functools.partial(qsa_index_topk_reference, topk=int(axes["TOPK"]),
                                     compress=int(axes["C"])))
  topk_ids = select(index_q, index_k, page_table, seq_lens)
  cache_shape = (num_pages, page, kv_heads, d)
  return {"q": jax.random.normal(key_q, (b, hq, d), jnp.bfloat16),
          "k_cache": jax.random.normal(key_k, cache_shape, jnp.bfloat16),
          "v_cache": jax.random.normal(key_v, cache_shape, jnp.bfloat16),
          "page_table": page_table, "seq_lens": seq_lens, "topk_ids": topk_ids,
          "sm_scale": jnp.asarray(d ** -0.5, jnp.float32)}


# ---------------------------------------------------------------------------
# Roofline cost (`OpImpl.cost`, see `jaxkern.roofline`).


def qsa_sparse_gqa_decode_cost(definition, axes, *, inputs=None, record=None):
  """QSA sparse GQA decode: a sequence sees at most its TOPK selected blocks
  of C tokens plus an incomplete tail (< C tokens), and at most its page
  table's MP*P tokens: t = min(MP*P, TOPK*C + C - 1) per sequence, FLOPs
  4 B HQ t D. Bytes: q, page_table, seq_lens, topk_ids, scalar read and o
  written once; of k_cache and v_cache only gathered token rows (all HKV
  heads of a token), at most min(B*t, NP*P) distinct tokens."""
  t = min(axes["MP"] * axes["P"], axes["TOPK"] * axes["C"] + axes["C"] - 1)
  tokens = axes["NP"] * axes["P"]
  caches = roofline.tensor_bytes(definition, "k_cache", axes) + roofline.tensor_bytes(definition, "v_cache", axes)
  gathered = min(axes["B"] * t, tokens) * (caches // max(tokens, 1))
  nbytes = roofline.io_bytes(definition, axes, skip=("k_cache", "v_cache")) + gathered
  return 4 * axes["B"] * axes["HQ"] * t * axes["D"], nbytes, "bf16"


# How the op splits across devices (`jaxkern.spmd`): sequences and heads (q
# heads with the kv head they read: q head h reads kv head h // (HQ/HKV)).
SPLIT = Split(inputs={"q": "b h d", "k_cache": "np ps h d", "v_cache": "np ps h d", "page_table": "b mp",
                      "seq_lens": "b", "topk_ids": "b k", "sm_scale": ""},
              outputs=("b h d",), independent="b h",
              reasons={"np": "page tables address the whole cache", "d": CONTRACTION})
IMPL = OpImpl(
    reference=qsa_sparse_gqa_decode_reference,
    kernel=gqa_lib.qsa_sparse_gqa_decode,
    make_inputs=make_gqa_inputs,
    choose_config=gqa_lib.choose_config,
    candidate_configs=gqa_lib.candidate_configs,
    cpu_axes=cpu_axes,
    cost=qsa_sparse_gqa_decode_cost,
    axis_params=AXIS_PARAMS,
    split=SPLIT,
)
IMPLS = (IMPL,)


# ---------------------------------------------------------------------------
# Public op (`jaxkern.ops`), dispatched by `jaxkern.dispatch`.


def qsa_sparse_gqa_decode(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, page_table: jax.Array,
                          seq_lens: jax.Array, topk_ids: jax.Array, sm_scale: float | jax.Array | None = None,
                          *, config: Any = None, backend: dispatch.Backend = None) -> jax.Array:
  """QSA sparse decode: q [B, 24, 256] over the 4-token blocks in topk_ids
  [B, 512] (-1 = empty) plus the incomplete tail, paged k/v_cache
  [NP, 64, 2, 256]; GQA (12 q heads per kv head); sm_scale defaults to
  256**-0.5. Returns [B, 24, 256] in q's dtype."""
  sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
  inputs = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "page_table": page_table, "seq_lens": seq_lens,
            "topk_ids": topk_ids, "sm_scale": jnp.asarray(sm_scale, jnp.float32)}
  return dispatch.run(IMPL, inputs, config=config, backend=backend)
