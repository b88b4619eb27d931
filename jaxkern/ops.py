"""Model-friendly, jit-compatible entry points.

Each op takes plain arrays (no input dicts) and a `backend`:
  None         the Pallas kernel on a GPU, the XLA path otherwise (default)
  "pallas"     the Pallas kernel (interpret mode when no GPU is present)
  "xla"        the plain-jnp path (the definitions' references): correct
               everywhere, fast on CPU
`config` picks a kernel config (see `pallas_kernels.<family>`); None lets the
heuristic choose.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp

from jaxkern.families import attention as _attention
from jaxkern.families import gemm as _gemm
from jaxkern.families import mixed_mla as _mixed_mla
from jaxkern.families import moe_router as _router
from pallas_kernels import flash_attention as _flash
from pallas_kernels import mixed_mla as _mixed_mla_kernel
from pallas_kernels import moe_router as _router_kernel
from pallas_kernels.common import has_gpu

Backend = Literal["pallas", "xla"] | None


def _pallas(backend: Backend) -> bool:
  if backend is None:
    return has_gpu()
  if backend not in ("pallas", "xla"):
    raise ValueError(f"backend must be None, 'pallas' or 'xla', got {backend!r}")
  return backend == "pallas"


def dense_gemm(a: jax.Array, b: jax.Array, *, config: Any = None, backend: Backend = None) -> jax.Array:
  """`a @ b.T`: activations a [..., K], weight b [N, K] (torch Linear layout);
  fp32 accumulation, output in a's dtype."""
  if _pallas(backend):
    return _gemm.dense_gemm(a, b, config=config)
  return jnp.einsum("...k,nk->...n", a, b, preferred_element_type=jnp.float32).astype(a.dtype)


def moe_router(hidden: jax.Array, weight: jax.Array, bias: jax.Array,
               routed_scaling_factor: float | jax.Array = 1.5, *, top_k: int = 6, config: Any = None,
               backend: Backend = None) -> tuple[jax.Array, jax.Array]:
  """DeepSeek-V4 sqrtsoftplus router: hidden [..., D], weight [E, D], bias [E]
  -> (expert_ids int32 [..., top_k] ascending, expert_weights f32 [..., top_k])."""
  if _pallas(backend):
    return _router.moe_router(hidden, weight, bias, routed_scaling_factor, top_k=top_k, config=config)
  *batch, d = hidden.shape
  ids, weights = _router_kernel.moe_router_topk_reference(hidden.reshape(-1, d), weight, bias,
                                                          routed_scaling_factor, top_k=top_k)
  return ids.reshape(*batch, top_k), weights.reshape(*batch, top_k)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, key_valid: jax.Array | None = None,
              sm_scale: float | None = None, config: Any = None, backend: Backend = None) -> jax.Array:
  """Non-causal attention, [B, N, H, D] layout; `key_valid [B, Nk]` hides
  keys, rows with no visible key are 0; scale defaults to D**-0.5."""
  if _pallas(backend):
    return _attention.attention(q, k, v, key_valid=key_valid, sm_scale=sm_scale, config=config)
  return _flash.attention_reference(q, k, v, key_valid=key_valid, sm_scale=sm_scale)


def prefix_cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, k_prefix: jax.Array,
                            v_prefix: jax.Array, *, sm_scale: float | None = None, config: Any = None,
                            backend: Backend = None) -> jax.Array:
  """Attention of q over keys concat(k_prefix, k), all visible; the
  concatenation is never materialized by the kernel."""
  if _pallas(backend):
    return _attention.prefix_cached_attention(q, k, v, k_prefix, v_prefix, sm_scale=sm_scale, config=config)
  return _flash.attention_reference(q, k, v, k_prefix=k_prefix, v_prefix=v_prefix, sm_scale=sm_scale)


def block_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                           sm_scale: float | None = None, config: Any = None, backend: Backend = None) -> jax.Array:
  """Self-attention where token j is visible to token i iff
  segment_ids[b, j] <= segment_ids[b, i] (nondecreasing int32 ids)."""
  if _pallas(backend):
    return _attention.block_causal_attention(q, k, v, segment_ids, sm_scale=sm_scale, config=config)
  return _flash.attention_reference(q, k, v, segment_ids=segment_ids, sm_scale=sm_scale)


def mixed_mla_decode(q: jax.Array, kv_fp8: jax.Array, indices_fp8: jax.Array, kv_fp4: jax.Array,
                     indices_fp4: jax.Array, attn_sink: jax.Array,
                     sm_scale: float | jax.Array | None = None, *, config: Any = None,
                     backend: Backend = None) -> tuple[jax.Array, jax.Array]:
  """DeepSeek-V4 MLA decode over an FP8 window cache and an FP4 compressed cache.

  q [B, H, D] bf16; kv_fp8 [N8, P8, 1, D + D/32] uint8 token records (see
  `jaxkern.quant.quantize_mla_fp8_tokens`) read at flat rows indices_fp8
  [B, K8]; kv_fp4 [N4, P4, 1, D/2 + D/16] uint8 (`quantize_mla_fp4_tokens`)
  read at indices_fp4 [B, K4]; negative or out-of-range indices are skipped;
  attn_sink [H] f32 joins the softmax denominator only; sm_scale defaults to
  D**-0.5. Returns (out [B, H, D] bf16, lse [B, H] f32 natural log without
  the sink; rows with no valid index: 0 and +inf)."""
  if sm_scale is None:
    sm_scale = q.shape[-1] ** -0.5
  sm_scale = jnp.asarray(sm_scale, jnp.float32)
  if _pallas(backend):
    return _mixed_mla_kernel.mixed_mla_decode(q, kv_fp8, indices_fp8, kv_fp4, indices_fp4, sm_scale,
                                              attn_sink, config=config)
  return _mixed_mla.mixed_mla_decode_reference(q, kv_fp8, indices_fp8, kv_fp4, indices_fp4, sm_scale,
                                               attn_sink)
