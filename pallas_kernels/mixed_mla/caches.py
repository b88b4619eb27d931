"""What the mixed MLA decode backends share: the problem sizes, the checks of
the inputs (the token record layouts of SPEC 4.10), and the stand-ins for
empty caches and slot tables."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.mixed_mla.config import CHUNK

FP4_GROUP = 16  # dims per UE8M0 scale of the FP4 records


class MixedMlaSizes(NamedTuple):
  """Problem sizes of the inputs' shapes (input name -> array or ShapeDtypeStruct)."""

  batch: int
  heads: int
  head_dim: int
  k8: int  # FP8 window slots per sequence
  k4: int  # FP4 compressed slots per sequence

  @classmethod
  def of(cls, shapes: Mapping[str, Any]) -> MixedMlaSizes:
    batch, heads, head_dim = shapes["q"].shape
    return cls(
      int(batch), int(heads), int(head_dim), int(shapes["indices_fp8"].shape[1]), int(shapes["indices_fp4"].shape[1])
    )


def fp8_record_bytes(head_dim: int) -> int:
  """D e4m3 bytes, then one little-endian f32 scale per 128 dims."""
  return head_dim + 4 * (head_dim // CHUNK)


def fp4_record_bytes(head_dim: int) -> int:
  """D / 2 bytes of packed e2m1, then one UE8M0 scale byte per 16 dims."""
  return head_dim // 2 + head_dim // FP4_GROUP


def check_inputs(
  q: jax.Array,
  kv_fp8: jax.Array,
  indices_fp8: jax.Array,
  kv_fp4: jax.Array,
  indices_fp4: jax.Array,
  attn_sink: jax.Array,
) -> None:
  """Raises ValueError naming the input and what it must be: D a multiple of
  128, caches `[pages, page size, 1, bytes]` with the record sizes of D,
  index tables `[B, K]`, attn_sink `[H]`."""
  batch, heads, head_dim = q.shape
  if head_dim % CHUNK:
    raise ValueError(f"D={head_dim} must be a multiple of {CHUNK}")
  if kv_fp8.ndim != 4 or kv_fp4.ndim != 4:
    raise ValueError(f"kv_fp8 {kv_fp8.shape} / kv_fp4 {kv_fp4.shape} must be [pages, page size, 1, bytes]")
  if kv_fp8.shape[2] != 1 or kv_fp4.shape[2] != 1:
    raise ValueError("one latent KV head expected")
  bytes8, bytes4 = kv_fp8.shape[3], kv_fp4.shape[3]
  if bytes8 != fp8_record_bytes(head_dim) or bytes4 != fp4_record_bytes(head_dim):
    raise ValueError(f"token records {bytes8}/{bytes4} bytes do not match D={head_dim}")
  if (
    indices_fp8.ndim != 2
    or indices_fp4.ndim != 2
    or indices_fp8.shape[0] != batch
    or indices_fp4.shape[0] != batch
    or attn_sink.shape != (heads,)
  ):
    raise ValueError(
      f"indices_fp8 {indices_fp8.shape}, indices_fp4 {indices_fp4.shape} must be [{batch}, K] "
      f"and attn_sink {attn_sink.shape} [{heads}]"
    )


def nonempty(cache: jax.Array, indices: jax.Array) -> tuple[jax.Array, jax.Array]:
  """A cache without rows gets one zero record and an index table without
  slots one invalid slot: nothing valid either way, and every load of a
  kernel stays in bounds."""
  if cache.shape[0] * cache.shape[1] == 0:
    cache = jnp.zeros((1, 1, *cache.shape[2:]), cache.dtype)
    indices = jnp.full(indices.shape, -1, jnp.int32)
  if indices.shape[1] == 0:
    indices = jnp.full((indices.shape[0], 1), -1, jnp.int32)
  return cache, indices.astype(jnp.int32)
