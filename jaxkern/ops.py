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
from jaxkern.families import gdn as _gdn
from jaxkern.families import gemm as _gemm
from jaxkern.families import moe_router as _router
from pallas_kernels import flash_attention as _flash
from pallas_kernels import gdn as _gdn_kernels
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


def gdn_decode(q: jax.Array, k: jax.Array, v: jax.Array, state: jax.Array, A_log: jax.Array,
               a: jax.Array, dt_bias: jax.Array, b: jax.Array, scale: float | jax.Array | None = None, *,
               config: Any = None, backend: Backend = None) -> tuple[jax.Array, jax.Array]:
  """Gated delta net decode step (Qwen3-Next): q, k [B, 1, HQ, D], v [B, 1, HV, D],
  k-last state [B, HV, V, K] f32, a, b [B, 1, HV], A_log, dt_bias [HV];
  scale None/0 -> D**-0.5. Returns (output [B, 1, HV, D] bf16, new_state f32)."""
  scale = 0.0 if scale is None else scale
  if _pallas(backend):
    return _gdn_kernels.gdn_decode(q, k, v, state, A_log, a, dt_bias, b, scale, config=config)
  return _gdn.gdn_decode_reference(q, k, v, state, A_log, a, dt_bias, b, scale)


def gdn_prefill(q: jax.Array, k: jax.Array, v: jax.Array, state: jax.Array, A_log: jax.Array,
                a: jax.Array, dt_bias: jax.Array, b: jax.Array, cu_seqlens: jax.Array,
                scale: float | jax.Array | None = None, *, config: Any = None,
                backend: Backend = None) -> tuple[jax.Array, jax.Array]:
  """Gated delta net over packed sequences (chunked on the Pallas path): q, k [T, HQ, D],
  v [T, HV, D], a, b [T, HV], initial k-last states [N, HV, V, K] f32, cu_seqlens
  [N + 1]. Returns (output [T, HV, D] bf16, final states f32; empty sequences 0)."""
  scale = 0.0 if scale is None else scale
  if _pallas(backend):
    return _gdn_kernels.gdn_prefill(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale,
                                    config=config)
  return _gdn.gdn_prefill_reference(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale)
