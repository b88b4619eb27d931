"""What the sparse MLA prefill backends share: the problem sizes, the checks
of the inputs, how TOPK splits cut the slot blocks into runs, and the
per-row table of slot blocks holding valid indices."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.shared.common import cdiv, check_pow2_dim


class SparseMlaSizes(NamedTuple):
  """Problem sizes of the inputs' shapes (input name -> array or ShapeDtypeStruct)."""

  m: int
  heads: int
  head_dim: int
  topk: int

  @classmethod
  def of(cls, shapes: Mapping[str, Any]) -> SparseMlaSizes:
    m, heads, head_dim = shapes["q"].shape
    return cls(int(m), int(heads), int(head_dim), int(shapes["indices"].shape[-1]))


def check_inputs(q: jax.Array, kv: jax.Array, indices: jax.Array, attn_sink: jax.Array) -> None:
  """Raises ValueError naming the input and the expected shape or dtype:
  kv `[Nkv, 1, D]` in q's dtype, indices `[M, 1, TOPK]`, attn_sink `[H]`,
  D a power of two >= 16."""
  m, num_heads, head_dim = q.shape
  if kv.ndim != 3 or kv.shape[1] != 1 or kv.shape[2] != head_dim:
    raise ValueError(f"kv {kv.shape} must be [Nkv, 1, {head_dim}]")
  if indices.ndim != 3 or indices.shape[:2] != (m, 1):
    raise ValueError(f"indices {indices.shape} must be [{m}, 1, TOPK]")
  if kv.dtype != q.dtype:
    raise ValueError(f"q and kv dtypes differ: {q.dtype}, {kv.dtype}")
  if attn_sink.shape != (num_heads,):
    raise ValueError(f"attn_sink {attn_sink.shape} must be [{num_heads}]")
  check_pow2_dim("head dim D", head_dim)


def blocks_per_split(topk: int, block_k: int, splits: int) -> int:
  """Slot blocks each split walks (the last split may walk fewer)."""
  return cdiv(cdiv(max(topk, 1), block_k), splits)


def split_runs(topk: int, block_k: int, splits: int) -> int:
  """`splits` cut to the runs the slot blocks actually make, none empty
  (10 blocks in 4 splits are runs of 3, 3, 3, 1: 4; 5 in 4 are 2, 2, 1: 3)."""
  blocks = cdiv(max(topk, 1), block_k)
  return cdiv(blocks, blocks_per_split(topk, block_k, min(splits, blocks)))


def slot_block_limits(indices: jax.Array, num_kv: int, block_k: int) -> jax.Array:
  """`[M, 2]` int32: per query row, the first slot block holding a valid
  index and one past the last (both 0 for a lonely row). `indices [M, TOPK]`."""
  topk = indices.shape[-1]
  valid = (indices >= 0) & (indices < num_kv)
  any_valid = jnp.any(valid, axis=-1)
  first = jnp.argmax(valid, axis=-1)
  end = topk - jnp.argmax(valid[:, ::-1], axis=-1)
  start_block = jnp.where(any_valid, first // block_k, 0)
  end_block = jnp.where(any_valid, (end + block_k - 1) // block_k, 0)
  return jnp.stack([start_block, end_block], axis=-1).astype(jnp.int32)
