"""Model-friendly, jit-compatible entry points: plain arrays in, arrays out.

Each op takes a `backend`:
  None         the Pallas kernel on a GPU, the XLA path otherwise (default)
  "pallas"     the Pallas kernel (interpret mode when no GPU is present)
  "xla"        the plain-jnp path (the definitions' references): correct
               everywhere, fast on CPU
and a `config` (see `pallas_kernels.<family>`). Without one, the tuned table
of the current device kind is consulted for the definition whose constant
axes match the call (`jaxkern.tuning`), else the kernel's heuristic decides.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Mapping

import jax
import jax.numpy as jnp

from jaxkern.families import dense_gemm as _gemm
from jaxkern.families import flash_attention as _attention
from jaxkern.families import gdn_decode as _gdn_decode
from jaxkern.families import gdn_prefill as _gdn_prefill
from jaxkern.families import grouped_gemm as _grouped
from jaxkern.families import mixed_mla as _mixed_mla
from jaxkern.families import moe_router as _router
from jaxkern.families import neighborhood_attention as _natten
from jaxkern.families import qsa_index as _qsa_index_family
from jaxkern.families import qsa_sparse_gqa as _qsa_gqa_family
from jaxkern.families import sparse_mla as _sparse_mla
from pallas_kernels import dense_gemm as _gemm_kernel
from pallas_kernels import flash_attention as _flash
from pallas_kernels import gdn_decode as _gdn_decode_kernel
from pallas_kernels import gdn_prefill as _gdn_prefill_kernel
from pallas_kernels import grouped_gemm as _grouped_kernel
from pallas_kernels import mixed_mla as _mixed_mla_kernel
from pallas_kernels import moe_router as _router_kernel
from pallas_kernels import neighborhood_attention as _natten_kernel
from pallas_kernels import qsa_index as _qsa_index
from pallas_kernels import qsa_sparse_gqa as _qsa_gqa
from pallas_kernels import sparse_mla as _sparse_mla_kernel
from pallas_kernels.common import has_gpu

Backend = Literal["pallas", "xla"] | None


def _pallas(backend: Backend) -> bool:
  if backend is None:
    return has_gpu()
  if backend not in ("pallas", "xla"):
    raise ValueError(f"backend must be None, 'pallas' or 'xla', got {backend!r}")
  return backend == "pallas"


def _config(reference: Callable[..., Any], shapes: Mapping[str, Any], config: Any,
            const_axes: Mapping[str, int] | None = None) -> Any:
  """The caller's config, else the tuned one for the definition that matches
  (shapes and `const_axes` such as a window size), else None (the kernel's
  heuristic)."""
  if config is not None:
    return config
  shapes = {k: v for k, v in shapes.items() if v is not None}
  from jaxkern import registry  # pylint: disable=g-import-not-at-top  (loads definitions lazily)
  op = registry.find(reference, shapes, const_axes=const_axes)
  if op is None:
    return None
  choice = op.config_for(shapes)
  return choice.config if choice.source == "tuned" else None


def dense_gemm(a: jax.Array, b: jax.Array, *, config: Any = None, backend: Backend = None) -> jax.Array:
  """`a @ b.T`: activations a [..., K], weight b [N, K] (torch Linear layout);
  fp32 accumulation, output in a's dtype."""
  *batch, k = a.shape
  a2 = a.reshape(-1, k)
  if _pallas(backend):
    config = _config(_gemm.dense_gemm_reference, {"A": a2, "B": b}, config)
    c = _gemm_kernel.dense_gemm_nt(a2, b, config=config, out_dtype=a.dtype)
  else:
    c = jnp.einsum("mk,nk->mn", a2, b, preferred_element_type=jnp.float32).astype(a.dtype)
  return c.reshape(*batch, b.shape[0])


def moe_router(hidden: jax.Array, weight: jax.Array, bias: jax.Array,
               routed_scaling_factor: float | jax.Array = 1.5, *, top_k: int = 6, config: Any = None,
               backend: Backend = None) -> tuple[jax.Array, jax.Array]:
  """DeepSeek-V4 sqrtsoftplus router: hidden [..., D], weight [E, D], bias [E]
  -> (expert_ids int32 [..., top_k] ascending, expert_weights f32 [..., top_k])."""
  *batch, d = hidden.shape
  h2 = hidden.reshape(-1, d)
  if _pallas(backend):
    config = _config(_router.moe_router_reference, {"hidden": h2, "weight": weight, "bias": bias}, config)
    ids, weights = _router_kernel.moe_router_topk(h2, weight, bias, routed_scaling_factor, top_k=top_k,
                                                  config=config)
  else:
    ids, weights = _router.moe_router_reference(h2, weight, bias, routed_scaling_factor, top_k=top_k)
  return ids.reshape(*batch, top_k), weights.reshape(*batch, top_k)


def _flash_attention(reference, q, k, v, *, sm_scale, config, backend, **extra) -> jax.Array:
  if _pallas(backend):
    config = _config(reference, {"q": q, "k": k, "v": v, **extra}, config)
    return _flash.flash_attention(q, k, v, sm_scale=sm_scale, config=config, **extra)
  return _attention.attention_reference(q, k, v, sm_scale=sm_scale, **extra)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, key_valid: jax.Array | None = None,
              sm_scale: float | None = None, config: Any = None, backend: Backend = None) -> jax.Array:
  """Non-causal attention, [B, N, H, D] layout; `key_valid [B, Nk]` hides
  keys, rows with no visible key are 0; scale defaults to D**-0.5."""
  return _flash_attention(_attention.noncausal_attention_reference, q, k, v, key_valid=key_valid,
                          sm_scale=sm_scale, config=config, backend=backend)


def prefix_cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, k_prefix: jax.Array,
                            v_prefix: jax.Array, *, sm_scale: float | None = None, config: Any = None,
                            backend: Backend = None) -> jax.Array:
  """Attention of q over keys concat(k_prefix, k), all visible; the
  concatenation is never materialized by the kernel."""
  return _flash_attention(_attention.prefix_cached_attention_reference, q, k, v, k_prefix=k_prefix,
                          v_prefix=v_prefix, sm_scale=sm_scale, config=config, backend=backend)


def block_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                           sm_scale: float | None = None, config: Any = None, backend: Backend = None) -> jax.Array:
  """Self-attention where token j is visible to token i iff
  segment_ids[b, j] <= segment_ids[b, i] (nondecreasing int32 ids)."""
  return _flash_attention(_attention.block_causal_attention_reference, q, k, v, segment_ids=segment_ids,
                          sm_scale=sm_scale, config=config, backend=backend)


def neighborhood_attention_3d(q: jax.Array, k: jax.Array, v: jax.Array, *,
                              kernel_size: int | tuple[int, int, int], config: Any = None,
                              backend: Backend = None) -> jax.Array:
  """3-D neighborhood attention, NATTEN `na3d` semantics with `scale=1` (q
  already scaled): q, k, v [B, T, Y, X, H, D]; each query attends to the
  `kernel_size` (KT, KY, KX, or one int for all) window around it, shifted
  inward at the borders. Returns o [B, T, Y, X, H, D] in q's dtype."""
  kt, ky, kx = (kernel_size,) * 3 if isinstance(kernel_size, int) else kernel_size
  window = {"KT": kt, "KY": ky, "KX": kx}
  if _pallas(backend):
    config = _config(_natten.neighborhood_attention_3d_reference, {"q": q, "k": k, "v": v}, config, window)
    return _natten_kernel.neighborhood_attention_3d(q, k, v, **window, config=config)
  return _natten.neighborhood_attention_3d_reference(q, k, v, **window)


def grouped_gemm_fp8_fp4(a: jax.Array, a_scale: jax.Array, b: jax.Array, b_scale: jax.Array,
                         expert_ids: jax.Array, *, config: Any = None, backend: Backend = None) -> jax.Array:
  """MoE expert GEMM, FP8 activations x MXFP4 weights (SPEC 4.3): a [M, K]
  float8_e4m3fn with UE8M0 a_scale [M, K/32]; b [E, N, K/2] packed e2m1 with
  UE8M0 b_scale [E, N, K/32]; rows grouped by expert_ids [M] (-1 = padding
  row -> 0). Returns bf16 [M, N]. Quantizers: `jaxkern.quant`."""
  if _pallas(backend):
    shapes = {"a": a, "a_scale": a_scale, "b": b, "b_scale": b_scale, "expert_ids": expert_ids}
    config = _config(_grouped.grouped_gemm_fp8_fp4_reference, shapes, config)
    return _grouped_kernel.grouped_gemm_fp8_fp4(a, a_scale, b, b_scale, expert_ids, config=config)
  return _grouped.grouped_gemm_fp8_fp4_reference(a, a_scale, b, b_scale, expert_ids)


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
  args = dict(q=q, kv_fp8=kv_fp8, indices_fp8=indices_fp8, kv_fp4=kv_fp4, indices_fp4=indices_fp4,
              sm_scale=sm_scale, attn_sink=attn_sink)
  if _pallas(backend):
    config = _config(_mixed_mla.mixed_mla_decode_reference, args, config)
    return _mixed_mla_kernel.mixed_mla_decode(**args, config=config)
  return _mixed_mla.mixed_mla_decode_reference(**args)


def sparse_mla_prefill(q: jax.Array, kv: jax.Array, indices: jax.Array, attn_sink: jax.Array, *,
                       sm_scale: float | jax.Array | None = None, config: Any = None,
                       backend: Backend = None) -> tuple[jax.Array, jax.Array]:
  """DeepSeek sparse MLA prefill (FlashMLA sparse semantics): q [M, H, D],
  latent workspace kv [Nkv, D] or [Nkv, 1, D] (key and value), indices
  [M, TOPK] or [M, 1, TOPK] int32 (negative or >= Nkv = invalid), per-head
  sink logits attn_sink [H] (denominator only); sm_scale defaults to D**-0.5.
  Returns (out [M, H, D] in q's dtype, lse [M, H] f32, natural log, sink
  excluded); a row with no valid index gives 0 and +inf."""
  m, _, d = q.shape
  args = dict(q=q, kv=kv.reshape(kv.shape[0], 1, d), indices=indices.reshape(m, 1, indices.shape[-1]),
              sm_scale=jnp.asarray(d ** -0.5 if sm_scale is None else sm_scale, jnp.float32), attn_sink=attn_sink)
  if _pallas(backend):
    config = _config(_sparse_mla.sparse_mla_prefill_reference, args, config)
    return _sparse_mla_kernel.sparse_mla_prefill(**args, config=config)
  return _sparse_mla.sparse_mla_prefill_reference(**args)


def qsa_index_topk(q: jax.Array, index_k: jax.Array, page_table: jax.Array, seq_lens: jax.Array, *,
                   config: Any = None, backend: Backend = None) -> jax.Array:
  """QSA indexer: q [B, 4, 128], paged compressed keys index_k [NP, 16, 1, 128],
  page_table [B, MP], seq_lens [B] tokens -> int32 [B, 512] top-512 block ids
  (block = 4 tokens) by sum_h relu(q_h . k) / sqrt(128), ascending, -1 suffix."""
  if _pallas(backend):
    config = _config(_qsa_index_family.qsa_index_topk_reference,
                     {"q": q, "index_k": index_k, "page_table": page_table, "seq_lens": seq_lens}, config)
    return _qsa_index.qsa_index_topk(q, index_k, page_table, seq_lens, config=config)
  return _qsa_index_family.qsa_index_topk_reference(q, index_k, page_table, seq_lens)


def qsa_sparse_gqa_decode(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, page_table: jax.Array,
                          seq_lens: jax.Array, topk_ids: jax.Array, sm_scale: float | jax.Array | None = None,
                          *, config: Any = None, backend: Backend = None) -> jax.Array:
  """QSA sparse decode: q [B, 24, 256] over the 4-token blocks in topk_ids
  [B, 512] (-1 = empty) plus the incomplete tail, paged k/v_cache
  [NP, 64, 2, 256]; GQA (12 q heads per kv head); sm_scale defaults to
  256**-0.5. Returns [B, 24, 256] in q's dtype."""
  if sm_scale is None:
    sm_scale = q.shape[-1] ** -0.5
  if _pallas(backend):
    config = _config(_qsa_gqa_family.qsa_sparse_gqa_decode_reference,
                     {"q": q, "k_cache": k_cache, "v_cache": v_cache, "page_table": page_table,
                      "seq_lens": seq_lens, "topk_ids": topk_ids}, config)
    return _qsa_gqa.qsa_sparse_gqa_decode(q, k_cache, v_cache, page_table, seq_lens, topk_ids, sm_scale,
                                          config=config)
  return _qsa_gqa_family.qsa_sparse_gqa_decode_reference(q, k_cache, v_cache, page_table, seq_lens, topk_ids,
                                              jnp.asarray(sm_scale, jnp.float32))


def gdn_decode(q: jax.Array, k: jax.Array, v: jax.Array, state: jax.Array, A_log: jax.Array,  # pylint: disable=invalid-name
               a: jax.Array, dt_bias: jax.Array, b: jax.Array, scale: float | jax.Array | None = None, *,
               config: Any = None, backend: Backend = None) -> tuple[jax.Array, jax.Array]:
  """Gated delta net decode step (Qwen3-Next): q, k [B, 1, HQ, D], v [B, 1, HV, D],
  k-last state [B, HV, V, K] f32, a, b [B, 1, HV], A_log, dt_bias [HV];
  scale None/0 -> D**-0.5. Returns (output [B, 1, HV, D] bf16, new_state f32)."""
  args = dict(q=q, k=k, v=v, state=state, A_log=A_log, a=a, dt_bias=dt_bias, b=b,
              scale=jnp.asarray(0.0 if scale is None else scale, jnp.float32))
  if _pallas(backend):
    config = _config(_gdn_decode.gdn_decode_reference, args, config)
    return _gdn_decode_kernel.gdn_decode(**args, config=config)
  return _gdn_decode.gdn_decode_reference(**args)


def gdn_prefill(q: jax.Array, k: jax.Array, v: jax.Array, state: jax.Array, A_log: jax.Array,  # pylint: disable=invalid-name
                a: jax.Array, dt_bias: jax.Array, b: jax.Array, cu_seqlens: jax.Array,
                scale: float | jax.Array | None = None, *, config: Any = None,
                backend: Backend = None) -> tuple[jax.Array, jax.Array]:
  """Gated delta net over packed sequences (chunked on the Pallas path): q, k [T, HQ, D],
  v [T, HV, D], a, b [T, HV], initial k-last states [N, HV, V, K] f32, cu_seqlens
  [N + 1]. Returns (output [T, HV, D] bf16, final states f32; empty sequences 0)."""
  args = dict(q=q, k=k, v=v, state=state, A_log=A_log, a=a, dt_bias=dt_bias, b=b, cu_seqlens=cu_seqlens,
              scale=jnp.asarray(0.0 if scale is None else scale, jnp.float32))
  if _pallas(backend):
    config = _config(_gdn_prefill.gdn_prefill_reference, args, config)
    return _gdn_prefill_kernel.gdn_prefill(**args, config=config)
  return _gdn_prefill.gdn_prefill_reference(**args)
