"""The input contract of `jaxkern.ops` (`jaxkern.contract`, issue 51): one
validation before dispatch, so that every bad input raises the same
`InputError` with the same message on every backend an op has (xla, triton,
mosaic_gpu); the signature rules and their deprecated spellings; the
`jaxkern.backend` scope and `jaxkern.explain`.

Inputs are tiny: every bad case is refused before any kernel is traced."""

from __future__ import annotations

import contextvars
import dataclasses
import pickle
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import toy_backends as toy
from fuzz_inputs import TARGETS

import jaxkern
from jaxkern import backends, contract, dispatch, ops, quant, tuning

BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
IMPLS = {t.name: t.impl for t in TARGETS}


def arr(shape, dtype=BF16, seed=0):
  if jnp.issubdtype(dtype, jnp.integer):
    return jnp.zeros(shape, dtype)
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _grouped():
  a, a_scale = quant.quantize_fp8_e4m3(arr((4, 64), F32), 32)
  b, b_scale = quant.quantize_e2m1(arr((2, 8, 64), F32, seed=1), 32)
  return dict(a=a, a_scale=a_scale, b=b, b_scale=b_scale, expert_ids=jnp.asarray([0, 1, 0, -1], I32))


def _gdn(lead, hq=2, hv=4, d=16, states=2):
  return dict(
    q=arr((*lead, hq, d)),
    k=arr((*lead, hq, d)),
    v=arr((*lead, hv, d)),
    state=arr((states, hv, d, d), F32),
    A_log=arr((hv,), F32),
    a=arr((*lead, hv)),
    dt_bias=arr((hv,), F32),
    b=arr((*lead, hv)),
  )


# op -> (tensors by name in positional order, keyword arguments): inside every contract.
def bases():
  qkv = dict(q=arr((1, 4, 2, 16)), k=arr((1, 4, 2, 16)), v=arr((1, 4, 2, 16)))
  natten = arr((1, 2, 4, 4, 1, 16))
  return {
    "dense_gemm": (dict(a=arr((4, 16)), b=arr((8, 16))), {}),
    "attention": ({**qkv, "key_valid": jnp.ones((1, 4), bool)}, {}),
    "prefix_cached_attention": ({**qkv, "k_prefix": arr((1, 3, 2, 16)), "v_prefix": arr((1, 3, 2, 16))}, {}),
    "block_causal_attention": ({**qkv, "segment_ids": jnp.asarray([[0, 0, 1, 1]], I32)}, {}),
    "neighborhood_attention_3d": (dict(q=natten, k=natten, v=natten), {"kernel_size": (1, 3, 3)}),
    "gdn_decode": (_gdn((2, 1)), {}),
    "gdn_prefill": ({**_gdn((5,)), "cu_seqlens": jnp.asarray([0, 2, 5], I32)}, {}),
    "grouped_gemm_fp8_fp4": (_grouped(), {}),
    "grouped_gemm_mxfp4_ste": (
      dict(x=arr((4, 64)), w=arr((2, 8, 64), F32, seed=1), expert_ids=jnp.asarray([0, 1, 0, -1], I32)),
      {},
    ),
    "mixed_mla_decode": (
      dict(
        q=arr((1, 2, 128)),
        kv_fp8=jnp.zeros((1, 4, 1, 132), jnp.uint8),
        indices_fp8=jnp.asarray([[0, 1]], I32),
        kv_fp4=jnp.zeros((1, 4, 1, 72), jnp.uint8),
        indices_fp4=jnp.asarray([[2, -1]], I32),
        attn_sink=arr((2,), F32),
      ),
      {},
    ),
    "moe_router": (dict(hidden=arr((3, 16)), weight=arr((8, 16)), bias=arr((8,), F32)), {"top_k": 2}),
    "qsa_index_topk": (
      dict(
        q=arr((2, 4, 16)),
        index_k=arr((3, 16, 1, 16)),
        page_table=jnp.asarray([[0, 1], [2, 0]], I32),
        seq_lens=jnp.asarray([40, 9], I32),
      ),
      {},
    ),
    "qsa_sparse_gqa_decode": (
      dict(
        q=arr((2, 4, 16)),
        k_cache=arr((3, 8, 2, 16)),
        v_cache=arr((3, 8, 2, 16)),
        page_table=jnp.asarray([[0, 1], [2, 0]], I32),
        seq_lens=jnp.asarray([10, 5], I32),
        topk_ids=jnp.asarray([[0, 1, -1, -1], [0, -1, -1, -1]], I32),
      ),
      {},
    ),
    "sparse_mla_prefill": (
      dict(q=arr((3, 2, 16)), kv=arr((5, 16)), indices=jnp.asarray([[0, 1, 4, -1]] * 3, I32), attn_sink=arr((2,), F32)),
      {},
    ),
  }


@dataclasses.dataclass(frozen=True)
class Bad:
  op: str
  label: str
  tensors: dict  # replaced tensors
  message: str
  kwargs: dict = dataclasses.field(default_factory=dict)


P = "prefix_cached_attention"
BC = "block_causal_attention"
NA = "neighborhood_attention_3d"
GG = "grouped_gemm_fp8_fp4"
STE = "grouped_gemm_mxfp4_ste"
MLA = "mixed_mla_decode"
GQA = "qsa_sparse_gqa_decode"
SMLA = "sparse_mla_prefill"
BAD = [
  # The three cases measured in the issue: the XLA path ran them.
  Bad(
    NA,
    "window_larger_than_grid",
    {},
    "neighborhood_attention_3d: kernel_size must be a window (KT, KY, KX) with 1 <= each <= the grid "
    "(T, Y, X) = (2, 4, 4), got (3, 3, 3)",
    {"kernel_size": 3},
  ),
  Bad(GG, "bf16_a", {"a": arr((4, 64))}, "grouped_gemm_fp8_fp4: a must be float8_e4m3fn, got bfloat16"),
  Bad("dense_gemm", "f32_a_bf16_b", {"a": arr((4, 16), F32)}, "dense_gemm: b must be a's dtype float32, got bfloat16"),
  # dense GEMM
  Bad("dense_gemm", "rank", {"b": arr((8, 16, 1))}, "dense_gemm: b must be [N, K] (rank 2), got shape (8, 16, 1)"),
  Bad(
    "dense_gemm",
    "dtype",
    {"a": arr((4, 16), I32), "b": arr((8, 16), I32)},
    "dense_gemm: a must be a floating dtype, got int32",
  ),
  Bad(
    "dense_gemm",
    "axis",
    {"b": arr((8, 32))},
    "dense_gemm: b must be [N, K] = [*, 16] (K from a.shape[-1]), got shape (8, 32)",
  ),
  # attention
  Bad("attention", "rank", {"q": arr((1, 4, 16))}, "attention: q must be [B, Nq, H, D] (rank 4), got shape (1, 4, 16)"),
  Bad("attention", "dtype", {"v": arr((1, 4, 2, 16), F32)}, "attention: v must be q's dtype bfloat16, got float32"),
  Bad(
    "attention",
    "axis",
    {"k": arr((1, 4, 2, 8)), "v": arr((1, 4, 2, 8))},
    "attention: k must be [B, Nk, Hkv, D] = [1, *, *, 16] (B, D from q), got shape (1, 4, 2, 8)",
  ),
  Bad(
    "attention",
    "grouped_heads",
    {"k": arr((1, 4, 3, 16)), "v": arr((1, 4, 3, 16))},
    "attention: k must be [B, Nk, Hkv, D] with Hkv dividing H = 2 (q's heads), got shape (1, 4, 3, 16)",
  ),
  Bad(
    "attention",
    "window",
    {},
    "attention: window must be None or a (left, right) pair, each None (unbounded) or an int >= 0, got (-1, 2)",
    {"window": (-1, 2)},
  ),
  Bad(
    "attention",
    "softcap",
    {},
    "attention: softcap must be None or a positive finite Python number (compiled into the kernel), got 0.0",
    {"softcap": 0.0},
  ),
  Bad("attention", "causal", {}, "attention: causal must be a Python bool, got 1", {"causal": 1}),
  Bad(
    "attention",
    "cu_seqlens_alone",
    {},
    "attention: cu_seqlens_k must be an int32 array [S + 1] (cu_seqlens_q and cu_seqlens_k go together), got None",
    {"cu_seqlens_q": jnp.asarray([0, 4], I32)},
  ),
  Bad(
    "attention",
    "cu_seqlens_dtype",
    {},
    "attention: cu_seqlens_q must be int32, got float32",
    {"cu_seqlens_q": jnp.asarray([0, 4], F32), "cu_seqlens_k": jnp.asarray([0, 4], I32)},
  ),
  Bad(
    "attention",
    "cu_seqlens_axis",
    {},
    "attention: cu_seqlens_k must be [S + 1] = [2] (cu_seqlens_q's shape), got shape (3,)",
    {"cu_seqlens_q": jnp.asarray([0, 4], I32), "cu_seqlens_k": jnp.asarray([0, 2, 4], I32)},
  ),
  Bad(
    "attention",
    "packed_rank",
    {},
    "attention: q must be [T, H, D] (packed sequences: cu_seqlens given) (rank 3), got shape (1, 4, 2, 16)",
    {"cu_seqlens_q": jnp.asarray([0, 4], I32), "cu_seqlens_k": jnp.asarray([0, 4], I32)},
  ),
  Bad(
    "attention",
    "packed_key_valid",
    {"q": arr((4, 2, 16)), "k": arr((4, 2, 16)), "v": arr((4, 2, 16))},
    "attention: key_valid must be [Tk] = [4] (Tk from k), got shape (1, 4)",
    {"cu_seqlens_q": jnp.asarray([0, 4], I32), "cu_seqlens_k": jnp.asarray([0, 4], I32)},
  ),
  Bad(
    "attention",
    "key_valid_axis",
    {"key_valid": jnp.ones((1, 5), bool)},
    "attention: key_valid must be [B, Nk] = [1, 4] (B, Nk from k), got shape (1, 5)",
  ),
  Bad(
    "attention",
    "sm_scale_vector",
    {},
    "attention: sm_scale must be a scalar (shape ()), got shape (2,)",
    {"sm_scale": jnp.ones((2,), F32)},
  ),
  # prefix-cached attention
  Bad(
    P,
    "rank",
    {"k_prefix": arr((1, 3, 2))},
    "prefix_cached_attention: k_prefix must be [B, Np, H, D] = [1, *, 2, 16] (B, H, D from q), got shape (1, 3, 2)",
  ),
  Bad(
    P,
    "dtype",
    {"k_prefix": arr((1, 3, 2, 16), F32)},
    "prefix_cached_attention: k_prefix must be q's dtype bfloat16, got float32",
  ),
  Bad(
    P,
    "axis",
    {"v_prefix": arr((1, 2, 2, 16))},
    "prefix_cached_attention: v_prefix must be [B, Np, H, D] = [1, 3, 2, 16] (k_prefix's shape), "
    "got shape (1, 2, 2, 16)",
  ),
  # block-causal attention
  Bad(
    BC,
    "rank",
    {"segment_ids": jnp.zeros((4,), I32)},
    "block_causal_attention: segment_ids must be [B, N] = [1, 4] (B, N from q), got shape (4,)",
  ),
  Bad(
    BC,
    "dtype",
    {"segment_ids": jnp.zeros((1, 4), F32)},
    "block_causal_attention: segment_ids must be an integer dtype (int32), got float32",
  ),
  Bad(
    BC,
    "axis",
    {"k": arr((1, 5, 2, 16)), "v": arr((1, 5, 2, 16))},
    "block_causal_attention: k must be [B, Nk, H, D] = [1, 4, 2, 16] (B, N, H, D from q), got shape (1, 5, 2, 16)",
  ),
  # neighborhood attention
  Bad(
    NA,
    "rank",
    {"q": arr((2, 4, 4, 1, 16))},
    "neighborhood_attention_3d: q must be [B, T, Y, X, H, D] (rank 6), got shape (2, 4, 4, 1, 16)",
  ),
  Bad(
    NA,
    "dtype",
    {"v": arr((1, 2, 4, 4, 1, 16), F32)},
    "neighborhood_attention_3d: v must be q's dtype bfloat16, got float32",
  ),
  Bad(
    NA,
    "axis",
    {"k": arr((1, 2, 4, 5, 1, 16))},
    "neighborhood_attention_3d: k must be [B, T, Y, X, H, D] = [1, 2, 4, 4, 1, 16] (q's shape), got shape "
    "(1, 2, 4, 5, 1, 16)",
  ),
  Bad(
    NA,
    "kernel_size_pair",
    {},
    "neighborhood_attention_3d: kernel_size must be an int or a (KT, KY, KX) tuple of ints, got (1, 3)",
    {"kernel_size": (1, 3)},
  ),
  # GDN decode
  Bad(
    "gdn_decode",
    "rank",
    {"state": arr((2, 4, 16), F32)},
    "gdn_decode: state must be [B, HV, V, K] (rank 4), got shape (2, 4, 16)",
  ),
  Bad("gdn_decode", "dtype", {"q": arr((2, 1, 2, 16), I32)}, "gdn_decode: q must be a floating dtype, got int32"),
  Bad(
    "gdn_decode",
    "axis",
    {"v": arr((2, 1, 3, 16))},
    "gdn_decode: v must be [B, 1, HV, D] with HV a multiple of HQ = 2 (q.shape[-2]), got shape (2, 1, 3, 16)",
  ),
  Bad(
    "gdn_decode",
    "two_tokens",
    {"q": arr((2, 2, 2, 16))},
    "gdn_decode: q must be [B, 1, HQ, D] = [*, 1, *, *] (one token per sequence), got shape (2, 2, 2, 16)",
  ),
  # GDN prefill
  Bad(
    "gdn_prefill",
    "rank",
    {"cu_seqlens": jnp.asarray([[0], [2], [5]], I32)},
    "gdn_prefill: cu_seqlens must be [N + 1] = [3] (N from state.shape[0]), got shape (3, 1)",
  ),
  Bad(
    "gdn_prefill",
    "dtype",
    {"cu_seqlens": jnp.asarray([0, 2, 5], F32)},
    "gdn_prefill: cu_seqlens must be an integer dtype (int32), got float32",
  ),
  Bad(
    "gdn_prefill",
    "axis",
    {"a": arr((4, 4))},
    "gdn_prefill: a must be [T, HV] = [5, 4] (T from q, HV from v), got shape (4, 4)",
  ),
  # grouped GEMM
  Bad(
    GG,
    "rank",
    {"expert_ids": jnp.zeros((4, 1), I32)},
    "grouped_gemm_fp8_fp4: expert_ids must be [M] = [4] (M from a), got shape (4, 1)",
  ),
  Bad(
    GG,
    "dtype",
    {"b_scale": jnp.zeros((2, 8, 2), jnp.int8)},
    "grouped_gemm_fp8_fp4: b_scale must be uint8, got int8",
  ),
  Bad(
    GG,
    "axis",
    {"a_scale": jnp.zeros((4, 1), jnp.uint8)},
    "grouped_gemm_fp8_fp4: a_scale must be [M, K/32] = [4, 2] (M, K from a), got shape (4, 1)",
  ),
  # the straight-through grouped GEMM
  Bad(STE, "rank", {"w": arr((8, 64), F32)}, "grouped_gemm_mxfp4_ste: w must be [E, N, K] (rank 3), got shape (8, 64)"),
  Bad(
    STE,
    "dtype",
    {"x": arr((4, 64)).astype(jnp.float8_e4m3fn)},
    "grouped_gemm_mxfp4_ste: x must be bfloat16 or float16 or float32, got float8_e4m3fn",
  ),
  Bad(
    STE,
    "axis",
    {"w": arr((2, 8, 32), F32)},
    "grouped_gemm_mxfp4_ste: w must be [E, N, K] = [*, *, 64] (K = 64 from x), got shape (2, 8, 32)",
  ),
  Bad(
    STE,
    "k_groups",
    {"x": arr((4, 48)), "w": arr((2, 8, 48), F32)},
    "grouped_gemm_mxfp4_ste: x must be [M, K] with K a multiple of 32, got shape (4, 48)",
  ),
  # mixed MLA decode
  Bad(MLA, "rank", {"q": arr((2, 128))}, "mixed_mla_decode: q must be [B, H, D] (rank 3), got shape (2, 128)"),
  Bad(
    MLA,
    "dtype",
    {"kv_fp8": jnp.zeros((1, 4, 1, 132), jnp.int8)},
    "mixed_mla_decode: kv_fp8 must be uint8, got int8",
  ),
  Bad(
    MLA,
    "axis",
    {"indices_fp4": jnp.zeros((2, 2), I32)},
    "mixed_mla_decode: indices_fp4 must be [B, K4] = [1, *] (B from q), got shape (2, 2)",
  ),
  Bad(
    MLA,
    "record_bytes",
    {"kv_fp4": jnp.zeros((1, 4, 1, 64), jnp.uint8)},
    "mixed_mla_decode: kv_fp4 must be [N4, P4, 1, D/2 + D/16] = [*, *, 1, 72] (one latent KV head, D = 128 from "
    "q), got shape (1, 4, 1, 64)",
  ),
  # MoE router
  Bad(
    "moe_router",
    "rank",
    {"weight": arr((8, 16, 1))},
    "moe_router: weight must be [E, D] (rank 2), got shape (8, 16, 1)",
  ),
  Bad(
    "moe_router",
    "dtype",
    {"weight": arr((8, 16), F32)},
    "moe_router: weight must be hidden's dtype bfloat16, got float32",
  ),
  Bad(
    "moe_router",
    "axis",
    {"bias": arr((7,), F32)},
    "moe_router: bias must be [E] = [8] (E from weight.shape[0]), got shape (7,)",
  ),
  Bad(
    "moe_router",
    "top_k_above_e",
    {},
    "moe_router: top_k must be an int in [1, E] with E = 8 (weight.shape[0]), got 9",
    {"top_k": 9},
  ),
  # QSA index
  Bad(
    "qsa_index_topk", "rank", {"q": arr((2, 64))}, "qsa_index_topk: q must be [B, HQ, D] (rank 3), got shape (2, 64)"
  ),
  Bad(
    "qsa_index_topk",
    "dtype",
    {"page_table": jnp.zeros((2, 2), F32)},
    "qsa_index_topk: page_table must be an integer dtype (int32), got float32",
  ),
  Bad(
    "qsa_index_topk",
    "axis",
    {"seq_lens": jnp.zeros((3,), I32)},
    "qsa_index_topk: seq_lens must be [B] = [2] (B from q), got shape (3,)",
  ),
  # QSA sparse GQA decode
  Bad(
    GQA,
    "rank",
    {"topk_ids": jnp.zeros((2, 4, 1), I32)},
    "qsa_sparse_gqa_decode: topk_ids must be [B, TOPK] (rank 2), got shape (2, 4, 1)",
  ),
  Bad(
    GQA,
    "dtype",
    {"k_cache": arr((3, 8, 2, 16), F32)},
    "qsa_sparse_gqa_decode: k_cache must be q's dtype bfloat16, got float32",
  ),
  Bad(
    GQA,
    "axis",
    {"q": arr((2, 3, 16))},
    "qsa_sparse_gqa_decode: k_cache must be [NP, P, HKV, D] with HQ = 3 (q.shape[1]) a multiple of HKV, got shape "
    "(3, 8, 2, 16)",
  ),
  # sparse MLA prefill
  Bad(SMLA, "rank", {"q": arr((3, 32))}, "sparse_mla_prefill: q must be [M, H, D] (rank 3), got shape (3, 32)"),
  Bad(
    SMLA,
    "dtype",
    {"indices": jnp.zeros((3, 4), F32)},
    "sparse_mla_prefill: indices must be an integer dtype (int32), got float32",
  ),
  Bad(
    SMLA,
    "axis",
    {"attn_sink": arr((3,), F32)},
    "sparse_mla_prefill: attn_sink must be [H] = [2] (H from q), got shape (3,)",
  ),
]


def backends_of(op: str) -> list[str]:
  return ["xla", *IMPLS[op].kernels]


def call(op: str, tensors: dict, kwargs: dict, backend: str | None):
  return getattr(ops, op)(*tensors.values(), **kwargs, backend=backend)


def test_every_op_has_a_wrong_rank_a_wrong_dtype_and_a_mismatched_axis():
  public = {n for n in ops.__all__ if n not in ("Backend", "InputError", "checked")}
  assert public == set(bases()) == set(IMPLS)
  for op in public:
    assert {"rank", "dtype", "axis"} <= {b.label for b in BAD if b.op == op}, op


@pytest.mark.parametrize("op", sorted(bases()))
def test_the_valid_inputs_of_each_case_pass_on_the_xla_path(op):
  """The bad cases differ from these in the one tensor or argument they change."""
  tensors, kwargs = bases()[op]
  jax.block_until_ready(call(op, tensors, kwargs, "xla"))


@pytest.mark.parametrize(
  "bad,backend",
  [pytest.param(b, be, id=f"{b.op}-{b.label}-{be}") for b in BAD for be in backends_of(b.op)],
)
def test_a_bad_input_raises_the_same_error_on_every_backend(bad: Bad, backend: str):
  tensors, kwargs = bases()[bad.op]
  with pytest.raises(contract.InputError) as info:
    call(bad.op, {**tensors, **bad.tensors}, {**kwargs, **bad.kwargs}, backend)
  assert type(info.value) is contract.InputError
  assert str(info.value) == bad.message
  assert info.value.op == bad.op and bad.message.startswith(f"{bad.op}: {info.value.argument} must be ")


def test_the_error_is_a_value_and_a_type_error_and_pickles():
  bad = BAD[0]
  tensors, kwargs = bases()[bad.op]
  with pytest.raises(ValueError):
    call(bad.op, tensors, {**kwargs, **bad.kwargs}, "xla")
  with pytest.raises(TypeError):
    call(bad.op, tensors, {**kwargs, **bad.kwargs}, "xla")
  e = contract.InputError("dense_gemm", "b", "2-d", "3-d")
  again = pickle.loads(pickle.dumps(e))
  assert (str(again), again.argument, again.expected, again.got) == (str(e), "b", "2-d", "3-d")
  assert jaxkern.InputError is ops.InputError is contract.InputError


def test_validation_runs_under_jit_on_abstract_shapes():
  a, b = arr((4, 16)), arr((8, 32))
  with pytest.raises(contract.InputError, match=r"dense_gemm: b must be \[N, K\]"):
    jax.jit(lambda x, y: ops.dense_gemm(x, y, backend="triton"))(a, b)


# ---------------------------------------------------------------------------
# Signatures: tensors positional, the rest keyword-only; deprecated spellings.


SCALED = ("attention", P, BC, "gdn_decode", "gdn_prefill", MLA, GQA, SMLA)


@pytest.mark.parametrize("op", sorted(bases()))
def test_tensors_are_positional_and_everything_else_keyword_only(op):
  import inspect

  params = inspect.signature(getattr(ops, op)).parameters.values()
  tensors, _ = bases()[op]
  positional = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
  assert positional == list(tensors)
  keyword = {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
  assert {"config", "backend", "checks"} <= keyword
  assert ("sm_scale" in keyword) == (op in SCALED)
  assert "scale" not in keyword


def _deprecated(fn, *args, **kwargs):
  with pytest.warns(DeprecationWarning, match=r"^jaxkern\.ops\.") as record:
    out = fn(*args, **kwargs)
  assert all(w.filename == __file__ for w in record if issubclass(w.category, DeprecationWarning))
  return out


def _same(x, y):
  for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
    np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))


@pytest.mark.parametrize("op", ["gdn_decode", "gdn_prefill"])
def test_gdn_scale_positional_or_named_scale_still_works_with_a_warning(op):
  tensors, _ = bases()[op]
  fn = getattr(ops, op)
  want = fn(*tensors.values(), sm_scale=0.5, backend="xla")
  _same(_deprecated(fn, *tensors.values(), 0.5, backend="xla"), want)
  _same(_deprecated(fn, *tensors.values(), scale=0.5, backend="xla"), want)
  with pytest.raises(TypeError, match="got both scale= .* and sm_scale="):
    fn(*tensors.values(), scale=0.5, sm_scale=0.5, backend="xla")
  # None means D**-0.5, as in every op with a softmax scale.
  _same(fn(*tensors.values(), backend="xla"), fn(*tensors.values(), sm_scale=16**-0.5, backend="xla"))


@pytest.mark.parametrize("op", [MLA, GQA])
def test_positional_sm_scale_still_works_with_a_warning(op):
  tensors, _ = bases()[op]
  fn = getattr(ops, op)
  _same(_deprecated(fn, *tensors.values(), 0.25, backend="xla"), fn(*tensors.values(), sm_scale=0.25, backend="xla"))
  with pytest.raises(TypeError, match="multiple values for argument 'sm_scale'"):
    fn(*tensors.values(), 0.25, sm_scale=0.25, backend="xla")
  with pytest.raises(TypeError, match="positional arguments"):
    fn(*tensors.values(), 0.25, 1.0, backend="xla")


def test_positional_routed_scaling_factor_still_works_with_a_warning():
  tensors, kwargs = bases()["moe_router"]
  got = _deprecated(ops.moe_router, *tensors.values(), 2.0, **kwargs, backend="xla")
  _same(got, ops.moe_router(*tensors.values(), routed_scaling_factor=2.0, **kwargs, backend="xla"))


def test_the_current_spellings_warn_nothing():
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    for op, (tensors, kwargs) in bases().items():
      call(op, tensors, kwargs, "xla")


# ---------------------------------------------------------------------------
# jaxkern.backend: the default backend of a scope.


def test_backend_scopes_nest_and_a_call_argument_wins():
  assert backends.scoped() is None
  assert dispatch.resolve_backend(None)[0] == "xla"  # no GPU here
  with jaxkern.backend("triton") as name:
    assert name == "triton" and dispatch.resolve_backend(None) == ("triton", "the enclosing jaxkern.backend scope")
    with jaxkern.backend("mosaic_gpu"):
      assert dispatch.resolve_backend(None)[0] == "mosaic_gpu"
      assert dispatch.resolve_backend("xla")[0] == "xla"
      with jaxkern.backend(None):
        assert dispatch.resolve_backend(None)[0] == "xla"
    assert backends.scoped() == "triton"
    with pytest.raises(RuntimeError), jaxkern.backend("xla"):
      raise RuntimeError
    assert backends.scoped() == "triton"
  assert backends.scoped() is None
  with pytest.raises(ValueError, match="backend must be None or one of"), jaxkern.backend("cuda"):
    pass


def test_a_scope_sets_the_backend_of_every_op_call():
  seen = []

  def spy(kernel):
    def launch(*a, **k):
      seen.append(kernel.backend)
      return kernel.launch(*a, **k)

    return dataclasses.replace(kernel, launch=launch)

  impl = dataclasses.replace(toy.IMPL, kernels={b: spy(k) for b, k in toy.IMPL.kernels.items()})
  x = {"x": arr((16, 128), F32), "s": jnp.asarray(3.0, F32)}
  with jaxkern.backend("mosaic_gpu"):
    dispatch.run(impl, x, interpret=True)
    dispatch.run(impl, x, backend="triton", interpret=True)
  dispatch.run(impl, x, interpret=True)  # the default here: the XLA path, no kernel
  assert seen == ["mosaic_gpu", "triton"]
  # A public op in a scope: the kernel path validates and runs (interpret mode).
  a, b = arr((4, 16)), arr((8, 16))
  with jaxkern.backend("triton"):
    assert jaxkern.explain(ops.dense_gemm, a, b).backend == "triton"
    np.testing.assert_allclose(
      np.asarray(ops.dense_gemm(a, b), np.float32), np.asarray(ops.dense_gemm(a, b, backend="xla"), np.float32)
    )


def test_threads_do_not_inherit_a_scope_unless_run_in_its_context():
  seen = {}

  def record(key):
    seen[key] = backends.scoped()

  with jaxkern.backend("triton"):
    plain = threading.Thread(target=record, args=("plain",))
    copied = threading.Thread(target=contextvars.copy_context().run, args=(record, "copied"))
    plain.start(), copied.start()
    plain.join(), copied.join()
  assert seen == {"plain": None, "copied": "triton"}


def test_concurrent_scopes_in_threads_are_independent():
  barrier = threading.Barrier(2)
  seen = {}

  def work(name):
    with jaxkern.backend(name):
      barrier.wait()  # both scopes open at once
      seen[name] = dispatch.resolve_backend(None)[0]
      barrier.wait()

  threads = [threading.Thread(target=work, args=(n,)) for n in ("triton", "mosaic_gpu")]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert seen == {"triton": "triton", "mosaic_gpu": "mosaic_gpu"}
  assert backends.scoped() is None


# ---------------------------------------------------------------------------
# jaxkern.explain


def test_explain_names_the_xla_path_and_why():
  a, b = arr((4, 16)), arr((8, 16))
  e = jaxkern.explain(ops.dense_gemm, a, b)
  assert (e.requested, e.backend, e.kernel, e.config) == ("xla", "xla", "reference dense_gemm_reference", None)
  assert e.fallbacks == () and e.config_source == ""
  assert "without a GPU" in e.why_backend
  e = jaxkern.explain(ops.dense_gemm, a, b, backend="xla")
  assert e.why_backend == "the call's backend= argument"


def test_explain_names_the_kernel_its_config_and_where_the_config_came_from():
  from pallas_kernels.dense_gemm.config import DenseGemmConfig

  a, b = jax.ShapeDtypeStruct((4, 16), BF16), jax.ShapeDtypeStruct((8, 16), BF16)
  e = jaxkern.explain(ops.dense_gemm, a, b, backend="triton")
  assert (e.op, e.requested, e.backend, e.kernel) == ("dense_gemm", "triton", "triton", "dense_gemm (triton)")
  assert isinstance(e.config, DenseGemmConfig) and e.config_source.startswith("the backend's heuristic")
  given = DenseGemmConfig()
  e = jaxkern.explain(ops.dense_gemm, a, b, backend="pallas", config=given)
  assert (e.config, e.config_source) == (given, "the caller's config=")
  assert "dense_gemm: backend 'triton'" in str(jaxkern.explain(ops.dense_gemm, a, b, backend="triton"))
  with pytest.raises(contract.InputError, match="dense_gemm: b must be"):
    jaxkern.explain(ops.dense_gemm, a, jax.ShapeDtypeStruct((8, 32), BF16), backend="triton")


def test_explain_reports_a_tuned_entry_and_a_fallback(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXKERN_TUNED_DIR", str(tmp_path / "tuned"))
  mosaic_first = dataclasses.replace(
    toy.IMPL, kernels={"mosaic_gpu": toy.MOSAIC_GPU_KERNEL, "triton": toy.TRITON_KERNEL}
  )

  def op(x, s):
    return dispatch.run(mosaic_first, {"x": x, "s": s}, backend="pallas", interpret=True)

  s = jnp.asarray(3.0, F32)
  e = jaxkern.explain(op, arr((16, 128)), s)  # bf16: the Mosaic GPU toy refuses it
  assert (e.requested, e.backend) == ("pallas", "triton")
  assert len(e.fallbacks) == 1 and e.fallbacks[0].startswith("mosaic_gpu: ")
  assert "fell back: mosaic_gpu" in str(e)
  bucket = backends.bucket_of(toy.IMPL.kernels, {"x": arr((16, 128), F32), "s": s}, {}, {})
  tuning.record(toy.NAME, "triton", bucket, toy.ToyConfig(2), latency_ms=1.0)
  e = jaxkern.explain(op, arr((16, 128), F32), s)
  assert (e.backend, e.config, e.fallbacks) == ("triton", toy.ToyConfig(2), ())
  assert e.config_source.startswith("the tuned table's entry") and bucket in e.config_source


def test_explain_takes_one_op():
  with pytest.raises(ValueError, match="explain takes one jaxkern.ops op"):
    jaxkern.explain(lambda x: x + 1, arr((2,)))
