"""Dense attention (SPEC 4.4-4.6): the kit's data (launches; edge cases of
masks, prefixes and segments for the flash kernel in interpret mode;
lowering at each recorded extreme) and the family's own checks: masks that
must not leak, the key-block limits, the reference against float64 numpy,
the heuristic and input synthesis structure; empty batches and sequences, a
traced scale, hidden NaN/Inf keys; the gradients (custom VJP,
FlashAttention-2 backward kernels) against the XLA path and float64 finite
differences, exact zeros where masked, and their lowering. (The checks
themselves: test_definitions.py and kit.py.)"""

from __future__ import annotations

import functools

import gradients
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kit import EVERY_CANDIDATE, Case, MosaicGpuCall, TritonCall
from numerics import assert_bf16_close

from jaxkern import ops, registry
from jaxkern.families import flash_attention as fam
from pallas_kernels.flash_attention import keys as keys_lib
from pallas_kernels.flash_attention import mosaic_gpu as fa_mosaic
from pallas_kernels.flash_attention import triton as fa
from pallas_kernels.flash_attention import triton_bwd as fa_bwd
from pallas_kernels.flash_attention.config import MosaicAttentionConfig
from pallas_kernels.shared.lowering import lower_for_h100, triton_calls

# The Triton lowering's deprecation notice is expected (SPEC 2).

NONCAUSAL_D64 = "noncausal_dense_attention_h32_d64"
NONCAUSAL_D128 = "noncausal_dense_attention_h32_d128"
PREFIX = "prefix_cached_block_causal_h32_d128"
PREFIX0 = "prefix_cached_block_causal_h32_d128_prefix0"
CONST_AXES = {
  NONCAUSAL_D64: {"H": 32, "D": 64},
  NONCAUSAL_D128: {"H": 32, "D": 128},
  PREFIX: {"H": 32, "D": 128},
  PREFIX0: {"H": 32, "D": 128},
}

# The recorded var axes (shared/seed/workloads.jsonl), per definition.
RECORDED_AXES = {
  NONCAUSAL_D64: [
    dict(B=b, Nq=nq, Nk=nk)
    for b in (1, 2, 4)
    for nq, nk in (
      (51, 51),
      (51, 1024),
      (51, 1120),
      (51, 2352),
      (1120, 51),
      (2352, 51),
      (126, 126),
      (126, 1024),
      (126, 2560),
      (2560, 126),
    )
  ],
  NONCAUSAL_D128: [
    dict(B=b, Nq=nq, Nk=nk)
    for b in (1, 2, 4)
    for nq, nk in ((1120, 1120), (1120, 1024), (2352, 2352), (2352, 1024), (2560, 2560), (2560, 1024))
  ],
  PREFIX: [dict(B=1, Nq=nq, Np=np_) for nq, np_ in ((4096, 25), (6144, 30), (4096, 32), (4096, 4125))],
  PREFIX0: [dict(B=1, Nq=nq) for nq in (25, 30, 32, 4125)],
}
# The largest of them, where lowering is checked with every candidate config.
LOWERING_AXES = {
  NONCAUSAL_D64: [
    dict(B=4, Nq=2560, Nk=126),
    dict(B=4, Nq=126, Nk=2560),
    dict(B=4, Nq=2352, Nk=51),
    dict(B=4, Nq=51, Nk=2352),
  ],
  NONCAUSAL_D128: [dict(B=4, Nq=2560, Nk=2560), dict(B=4, Nq=2352, Nk=1024)],
  PREFIX: [dict(B=1, Nq=6144, Np=30), dict(B=1, Nq=4096, Np=4125)],
  PREFIX0: [dict(B=1, Nq=4125)],
}
SEGMENTS_4125 = [[0, 8, False], [8, 4104, True], [4104, 4125, False]]

# Small tilings for interpret-mode tests: several key and query blocks.
SMALL = fa.FlashAttentionConfig(block_q=32, block_k=16, num_warps=4, num_stages=2)


def normal(seed, shape, dtype=jnp.bfloat16):
  # numpy, not jax.random: no compilation per shape.
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), dtype)


def qkv(batch, q_len, kv_len, heads=2, head_dim=64, seed=0, dtype=jnp.bfloat16):
  return (
    normal(seed, (batch, q_len, heads, head_dim), dtype),
    normal(seed + 1, (batch, kv_len, heads, head_dim), dtype),
    normal(seed + 2, (batch, kv_len, heads, head_dim), dtype),
  )


def ids_from_ends(ends, batch=1):
  return fam.segment_ids_from_ends(list(ends), batch, ends[-1])


def launches(config, axes):
  """Grid (query blocks, B, H)."""
  return [
    TritonCall(
      "flash_attention", (-(-axes["Nq"] // config.block_q), axes["B"], axes["H"]), config.num_warps, config.num_stages
    )
  ]


def launches_mosaic_gpu(config, axes):
  """One Mosaic GPU call, grid (H, query blocks of 2 x block_q, B): q, k, v,
  the prefix (k and v again without one; sequences padded to multiples of
  8 rows), the key ids of every step (prefix steps first), the query ids
  and the key steps per query block in; o and lse (8-row padded) out."""
  b, nq, h, d = axes["B"], axes["Nq"], axes["H"], axes["D"]
  nk, np_ = axes.get("Nk", nq), axes.get("Np", 0)
  pad8 = lambda n: -(-n // 8) * 8  # noqa: E731
  steps = lambda n: -(-n // config.block_k)  # noqa: E731
  q_blocks = -(-nq // (2 * config.block_q))
  seq = lambda n: f"tensor<{b}x{pad8(n)}x{h}x{d}xbf16>"  # noqa: E731
  prefix = (seq(np_),) * 2 if np_ else (seq(nk),) * 2
  operands = (
    seq(nq),
    seq(nk),
    seq(nk),
    *prefix,
    f"tensor<{b}x{(steps(np_) + steps(nk)) * config.block_k}xi32>",
    f"tensor<{b}x{q_blocks * 2 * config.block_q}xi32>",
    f"tensor<{b}x{q_blocks}xi32>",
  )
  return [MosaicGpuCall(operands, (seq(nq), f"tensor<{b}x{h}x{pad8(nq)}xf32>"))]


# ---------------------------------------------------------------------------
# Kit data: edge cases (kernel in interpret mode vs reference), lowering.


def plain(batch, q_len, kv_len, head_dim=64, heads=2):
  """Noncausal inputs without a key mask (the kernel's unmasked path)."""
  return lambda: dict(zip("qkv", qkv(batch, q_len, kv_len, heads=heads, head_dim=head_dim)))


def with_key_valid(batch, q_len, kv_len, key_valid):
  def build():
    q, k, v = qkv(batch, q_len, kv_len)
    return {"q": q, "k": k, "v": v, "key_valid": key_valid}

  return build


def with_prefix(q_len, prefix_len):
  def build():
    q, k, v = qkv(1, q_len, q_len, head_dim=128)
    return {
      "q": q,
      "k": k,
      "v": v,
      "k_prefix": normal(7, (1, prefix_len, 2, 128)),
      "v_prefix": normal(8, (1, prefix_len, 2, 128)),
    }

  return build


def with_segments(batch, n, segment_ids, head_dim=128):
  def build():
    q, k, v = qkv(batch, n, n, head_dim=head_dim)
    return {"q": q, "k": k, "v": v, "segment_ids": segment_ids()}

  return build


def lonely_row_is_zero(out, ref, inputs):
  """Row 1 sees no key: exactly 0; row 0 sees all: non-zero everywhere."""
  o = np.asarray(out["o"], np.float32)
  assert np.all(o[1] == 0.0) and np.all(np.asarray(ref["o"][1], np.float32) == 0.0)
  assert np.all(np.abs(o[0]).max(axis=(1, 2)) > 0)


_LENGTHS = jnp.array([40, 0, 17, 1])  # row 1 sees nothing: lonely rows
# ... and a hole inside row 2's valid prefix: masks need not be prefixes.
_HOLED = (jnp.arange(40)[None] < _LENGTHS[:, None]).at[2, 5].set(False)

KERNEL_CASES = [
  *(
    Case(NONCAUSAL_D64, inputs=plain(b, nq, nk, d), config=SMALL, id=label)
    for b, nq, nk, d, label in [
      (1, 51, 51, 64, "audio_self_ragged"),
      (2, 70, 9, 64, "audio_to_video_like"),
      (2, 9, 70, 128, "video_to_audio_like"),
      (1, 1, 1, 64, "one_query_one_key"),
      (2, 37, 1, 128, "one_key"),
      (1, 64, 96, 64, "block_multiples_unmasked_only"),
    ]
  ),
  Case(
    NONCAUSAL_D64,
    inputs=with_key_valid(4, 33, 40, _HOLED),
    config=SMALL,
    check=lonely_row_is_zero,
    id="key_valid_lonely_row_and_hole",
  ),
  # Rows see nothing in the first masked blocks (-inf running max) before
  # reaching their visible keys: no NaN may leak into the result.
  Case(
    NONCAUSAL_D64,
    inputs=with_key_valid(2, 20, 50, jnp.stack([jnp.arange(50) >= 37, (jnp.arange(50) % 7) == 3])),
    config=SMALL,
    id="key_valid_leading_blocks_invisible",
  ),
  *(
    Case(PREFIX, inputs=with_prefix(nq, np_), config=SMALL, id=f"prefix_nq{nq}_np{np_}")
    for nq, np_ in [(40, 37), (9, 70), (1, 1), (48, 32)]
  ),
  *(
    Case(
      PREFIX0,
      inputs=with_segments(1, ends[-1], functools.partial(ids_from_ends, ends)),
      config=SMALL,
      id="segments_" + "_".join(map(str, ends)),
    )
    for ends in [(8, 104, 125), (125,), (1, 2, 3), (30, 31, 64, 100)]
  ),
  # Block skipping is an optimization; any ids give the exact mask.
  Case(
    PREFIX0,
    inputs=with_segments(
      2, 50, lambda: jnp.asarray(np.random.default_rng(3).integers(0, 4, (2, 50)), jnp.int32), head_dim=64
    ),
    config=SMALL,
    id="unsorted_segment_ids",
  ),
]
LOWERING_CASES = [
  *(Case(name, axes, config=EVERY_CANDIDATE) for name, all_axes in LOWERING_AXES.items() for axes in all_axes),
  Case(NONCAUSAL_D128, dict(B=4, Nq=2352, Nk=2352), omit=("key_valid",), id="without_key_mask"),
]
# The Mosaic GPU kernel through the op path (its lse and the rest of its
# edge cases: test_flash_attention_mosaic.py).
MOSAIC_SMALL = MosaicAttentionConfig(block_k=64)
KERNEL_CASES += [
  Case(
    NONCAUSAL_D64,
    inputs=with_key_valid(4, 33, 40, _HOLED),
    config=MOSAIC_SMALL,
    check=lonely_row_is_zero,
    id="mosaic_key_valid_lonely_row_and_hole",
    backend="mosaic_gpu",
  ),
  Case(PREFIX, inputs=with_prefix(40, 37), config=MOSAIC_SMALL, id="mosaic_prefix_nq40_np37", backend="mosaic_gpu"),
  Case(
    PREFIX0,
    inputs=with_segments(1, 125, functools.partial(ids_from_ends, (8, 104, 125))),
    config=MOSAIC_SMALL,
    id="mosaic_segments_8_104_125",
    backend="mosaic_gpu",
  ),
  Case(
    PREFIX0,
    inputs=with_segments(
      2, 50, lambda: jnp.asarray(np.random.default_rng(3).integers(0, 4, (2, 50)), jnp.int32), head_dim=64
    ),
    config=MOSAIC_SMALL,
    id="mosaic_unsorted_segment_ids",
    backend="mosaic_gpu",
  ),
]
SWEEP_CASE = Case(NONCAUSAL_D64, dict(B=1, Nq=70, Nk=200, H=1))
SWEEP_CASE_MOSAIC_GPU = Case(NONCAUSAL_D64, dict(B=1, Nq=20, Nk=130, H=1))


# ---------------------------------------------------------------------------
# The family's own kernel checks.


def test_empty_prefix_is_plain_attention():
  q, k, v = qkv(1, 20, 20)
  empty = jnp.zeros((1, 0, 2, 64), jnp.bfloat16)
  out = fa.flash_attention(q, k, v, k_prefix=empty, v_prefix=empty, config=SMALL, interpret=True)
  no_prefix = fa.flash_attention(q, k, v, config=SMALL, interpret=True)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(no_prefix, np.float32))


def test_block_causal_first_segment_ignores_later_keys():
  ends = (8, 104, 125)
  q, k, v = qkv(1, 125, 125, head_dim=128)
  segment_ids = ids_from_ends(ends)
  out = fa.flash_attention(q, k, v, segment_ids=segment_ids, config=SMALL, interpret=True)
  first = fa.flash_attention(q[:, :8], k[:, :8], v[:, :8], config=SMALL, interpret=True)
  np.testing.assert_array_equal(np.asarray(out[:, :8], np.float32), np.asarray(first, np.float32))


def test_all_masks_and_prefix_together():
  n = 45
  q, k, v = qkv(2, n, n)
  k_prefix, v_prefix = normal(7, (2, 11, 2, 64)), normal(8, (2, 11, 2, 64))
  key_valid = jnp.arange(n)[None] < jnp.array([[n], [30]])
  segment_ids = ids_from_ends((10, 33, n), batch=2)
  kwargs = dict(key_valid=key_valid, k_prefix=k_prefix, v_prefix=v_prefix, segment_ids=segment_ids, sm_scale=0.3)
  out = fa.flash_attention(q, k, v, config=SMALL, interpret=True, **kwargs)
  assert_bf16_close(out, fam.attention_reference(q, k, v, **kwargs))


def test_sm_scale_override():
  q, k, v = qkv(1, 20, 30)
  out = fa.flash_attention(q, k, v, sm_scale=0.5, config=SMALL, interpret=True)
  assert_bf16_close(out, fam.attention_reference(q, k, v, sm_scale=0.5))
  default = fam.attention_reference(q, k, v)
  assert np.abs(np.asarray(out, np.float32) - np.asarray(default, np.float32)).max() > 0.05


def test_key_block_limits():
  # Segments [0, 8), [8, 104), [104, 125); query blocks of 32, key blocks of 16.
  limits = fa.key_block_limits(
    None, ids_from_ends((8, 104, 125)), batch=1, q_len=125, kv_len=125, block_q=32, block_k=16
  )
  # Block 0 (rows 0-31) sees keys [0, 104) and all of them fully only up to 8.
  np.testing.assert_array_equal(limits[0], [[0, 7], [6, 7], [6, 7], [6, 8]])
  key_valid = jnp.arange(100)[None] < jnp.array([[100], [40], [0]])
  limits = fa.key_block_limits(key_valid, None, batch=3, q_len=10, kv_len=100, block_q=16, block_k=32)
  np.testing.assert_array_equal(limits[:, 0], [[3, 4], [1, 2], [0, 0]])


def test_key_block_limits_count_instead_of_search():
  """The segment limits are counts over the nondecreasing helper sequences
  (what a right-sided search returns), without a while loop before launch."""
  rng = np.random.default_rng(0)
  n, bq, bk = 77, 16, 8
  for seg in (np.sort(rng.integers(0, 6, size=(2, n)), axis=1), rng.integers(0, 6, size=(2, n))):
    seg = seg.astype(np.int32)
    limits = np.asarray(fa.key_block_limits(None, jnp.asarray(seg), batch=2, q_len=n, kv_len=n, block_q=bq, block_k=bk))
    padded = np.pad(seg, ((0, 0), (0, -n % bq)), mode="edge").reshape(2, -1, bq)
    for b in range(2):
      running_max = np.maximum.accumulate(seg[b])
      suffix_min = np.minimum.accumulate(seg[b][::-1])[::-1]
      full = np.searchsorted(running_max, padded[b].min(1), side="right")
      end = np.searchsorted(suffix_min, padded[b].max(1), side="right")
      n_blocks = -(-end // bk)
      np.testing.assert_array_equal(limits[b], np.stack([np.minimum(full // bk, n_blocks), n_blocks], -1))
  fn = functools.partial(fa.key_block_limits, None, batch=2, q_len=n, kv_len=n, block_q=bq, block_k=bk)
  assert "while" not in jax.jit(fn).lower(jnp.asarray(seg)).as_text()


# ---------------------------------------------------------------------------
# Reference vs float64 numpy.


def numpy_attention(q, k, v, visible, scale):
  """Naive float64 attention; visible [B, Nq, Nk]; lonely rows 0."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
  s = np.where(visible[:, None], s, -np.inf)
  m = s.max(axis=-1, keepdims=True)
  p = np.where(visible[:, None], np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
  l = p.sum(axis=-1, keepdims=True)
  return np.einsum("bhqk,bkhd->bqhd", p / np.where(l > 0, l, 1), v)


def test_reference_matches_float64_noncausal():
  q, k, v = qkv(2, 7, 5, heads=3, head_dim=8, dtype=jnp.float32)
  key_valid = np.array([[1, 0, 1, 1, 0], [0, 0, 0, 0, 0]], bool)
  ref = fam.attention_reference(q, k, v, key_valid=jnp.asarray(key_valid))
  want = numpy_attention(q, k, v, np.broadcast_to(key_valid[:, None], (2, 7, 5)), 8**-0.5)
  np.testing.assert_allclose(np.asarray(ref), want, atol=2e-5, rtol=1e-4)
  assert np.all(np.asarray(ref[1]) == 0.0)


def test_reference_matches_float64_prefix_and_chunks():
  q, k, v = qkv(1, 9, 9, heads=2, head_dim=8, dtype=jnp.float32)
  k_prefix, v_prefix = normal(5, (1, 4, 2, 8), jnp.float32), normal(6, (1, 4, 2, 8), jnp.float32)
  # q_chunk=4 exercises the chunked (and padded) query path.
  ref = fam.attention_reference(q, k, v, k_prefix=k_prefix, v_prefix=v_prefix, q_chunk=4)
  want = numpy_attention(
    q, np.concatenate([k_prefix, k], 1), np.concatenate([v_prefix, v], 1), np.ones((1, 9, 13), bool), 8**-0.5
  )
  np.testing.assert_allclose(np.asarray(ref), want, atol=2e-5, rtol=1e-4)


def test_reference_matches_float64_segments():
  q, k, v = qkv(1, 10, 10, heads=2, head_dim=8, dtype=jnp.float32)
  ids = np.array([[0, 0, 1, 1, 1, 1, 1, 2, 2, 2]], np.int32)
  ref = fam.attention_reference(q, k, v, segment_ids=jnp.asarray(ids), q_chunk=3)
  want = numpy_attention(q, k, v, ids[:, None, :] <= ids[:, :, None], 8**-0.5)
  np.testing.assert_allclose(np.asarray(ref), want, atol=2e-5, rtol=1e-4)


def test_family_references_bf16():
  q, k, v = qkv(1, 6, 5, heads=2, head_dim=16)
  key_valid = jnp.array([[True, True, False, True, True]])
  out = fam.noncausal_attention_reference(q, k, v, key_valid)
  assert out.dtype == jnp.bfloat16 and out.shape == q.shape
  want = numpy_attention(q, k, v, np.broadcast_to(np.asarray(key_valid)[:, None], (1, 6, 5)), 0.25)
  assert_bf16_close(out, want)
  kp, vp = normal(9, (1, 3, 2, 16)), normal(10, (1, 3, 2, 16))
  out = fam.prefix_cached_attention_reference(q, k[:, :1], v[:, :1], kp, vp)
  want = numpy_attention(
    q, np.concatenate([kp, k[:, :1]], 1), np.concatenate([vp, v[:, :1]], 1), np.ones((1, 6, 4), bool), 0.25
  )
  assert_bf16_close(out, want)
  ids = jnp.array([[0, 0, 1, 2, 2, 2]], jnp.int32)
  q6, k6, v6 = qkv(1, 6, 6, heads=2, head_dim=16)
  out = fam.block_causal_attention_reference(q6, k6, v6, ids)
  want = numpy_attention(q6, k6, v6, np.asarray(ids)[:, None, :] <= np.asarray(ids)[:, :, None], 0.25)
  assert_bf16_close(out, want)


# ---------------------------------------------------------------------------
# Arguments, the heuristic.


def test_bad_arguments_raise():
  q, k, v = qkv(1, 8, 8)
  with pytest.raises(ValueError):
    fa.FlashAttentionConfig(block_q=48)
  with pytest.raises(ValueError):
    fa.flash_attention(q, k[:, :, :1], v, interpret=True)
  with pytest.raises(ValueError):
    fa.flash_attention(q, k, v, segment_ids=jnp.zeros((1, 9), jnp.int32), interpret=True)
  with pytest.raises(ValueError):
    fa.flash_attention(q[..., :24], k[..., :24], v[..., :24], interpret=True)


def input_avals(name, axes):
  a = {**axes, **CONST_AXES[name]}
  bf16 = lambda *dims: jax.ShapeDtypeStruct(tuple(a[d] for d in dims), jnp.bfloat16)
  if name in (NONCAUSAL_D64, NONCAUSAL_D128):
    return {
      "q": bf16("B", "Nq", "H", "D"),
      "k": bf16("B", "Nk", "H", "D"),
      "v": bf16("B", "Nk", "H", "D"),
      "key_valid": jax.ShapeDtypeStruct((a["B"], a["Nk"]), jnp.bool_),
    }
  if name == PREFIX:
    return {
      "q": bf16("B", "Nq", "H", "D"),
      "k": bf16("B", "Nq", "H", "D"),
      "v": bf16("B", "Nq", "H", "D"),
      "k_prefix": bf16("B", "Np", "H", "D"),
      "v_prefix": bf16("B", "Np", "H", "D"),
    }
  return {
    "q": bf16("B", "Nq", "H", "D"),
    "k": bf16("B", "Nq", "H", "D"),
    "v": bf16("B", "Nq", "H", "D"),
    "segment_ids": jax.ShapeDtypeStruct((a["B"], a["Nq"]), jnp.int32),
  }


@pytest.mark.parametrize("name", list(RECORDED_AXES))
def test_heuristic_config_at_every_recorded_size(name):
  op = registry.get(name)
  for axes in RECORDED_AXES[name]:
    avals = input_avals(name, axes)
    config = op.choose_config(avals)
    candidates = op.candidate_configs(avals)
    assert config == candidates[0] and len(candidates) == len(set(candidates)) >= 3
    # Query tiles no larger than the query count needs (51 -> 64), and 128-row
    # tiles only where they still give at least two programs per SM.
    q_len = axes["Nq"]
    programs = axes["B"] * 32 * -(-q_len // config.block_q)
    assert config.block_q <= max(16, 1 << (q_len - 1).bit_length())
    assert config.block_q == 64 or programs >= 2 * 132 or q_len <= 64, (axes, config)


# ---------------------------------------------------------------------------
# Input synthesis and CPU scale.


def recorded_like(name, axes):
  if name in (PREFIX, PREFIX0):
    return {"definition": name, "axes": dict(axes), "prefix_segments": SEGMENTS_4125}
  return {"definition": name, "axes": dict(axes), "variant": "attn2"}


def test_synthesis_scales():
  impl = registry.get(PREFIX0).impl
  axes = impl.cpu_axes({**RECORDED_AXES[PREFIX0][-1], **CONST_AXES[PREFIX0]})
  q = np.asarray(impl.make_inputs(axes, jax.random.key(5), None)["q"], np.float32)
  assert 0.9 < q.std() < 1.1 and abs(q.mean()) < 0.05


def test_key_valid_for_padded_text_variants():
  # Small H and D: the mask does not depend on them.
  axes = {"B": 4, "Nq": 51, "Nk": 1024, "H": 1, "D": 16}
  impl = registry.get(NONCAUSAL_D64).impl
  for variant in ("audio_attn2", "attn2"):
    kv = np.asarray(impl.make_inputs(axes, jax.random.key(0), {"variant": variant})["key_valid"])
    lengths = kv.sum(axis=1)
    # A valid prefix per batch row, of length in [Nk/8, Nk].
    np.testing.assert_array_equal(kv, np.arange(1024)[None] < lengths[:, None])
    assert np.all(lengths >= 128) and np.all(lengths <= 1024)
    assert len(set(lengths.tolist())) > 1
  for record in (None, {"variant": "audio_attn1"}, {"variant": "video_to_audio_attn"}):
    assert np.asarray(impl.make_inputs(axes, jax.random.key(0), record)["key_valid"]).all()
  # A record with larger axes than the run's: the mask follows the run's Nk.
  small = {"B": 2, "Nq": 51, "Nk": 100, "H": 1, "D": 16}
  kv = np.asarray(
    impl.make_inputs(small, jax.random.key(0), {"variant": "attn2", "axes": {"B": 4, "Nq": 51, "Nk": 1024}})[
      "key_valid"
    ]
  )
  assert kv.shape == (2, 100) and np.all(kv.sum(axis=1) >= 13)


def test_segment_ids_from_record():
  impl = registry.get(PREFIX0).impl
  axes = {"B": 1, "Nq": 4125, "H": 1, "D": 16}  # The ids do not depend on H, D.
  ids = np.asarray(impl.make_inputs(axes, jax.random.key(0), recorded_like(PREFIX0, axes))["segment_ids"])
  want = np.concatenate([np.zeros(8), np.ones(4096), np.full(21, 2)]).astype(np.int32)
  np.testing.assert_array_equal(ids[0], want)
  ids = np.asarray(impl.make_inputs(axes, jax.random.key(0), None)["segment_ids"])
  assert ids.shape == (1, 4125) and not ids.any()  # No record: one segment.


@pytest.mark.parametrize("q_len", [349, 125, 40, 4, 3, 2, 1])
def test_segment_ids_rescaled_record(q_len):
  impl = registry.get(PREFIX0).impl
  axes = {"B": 2, "Nq": q_len, "H": 1, "D": 16}
  record = {"axes": {"B": 1, "Nq": 4125}, "prefix_segments": SEGMENTS_4125}
  ids = np.asarray(impl.make_inputs(axes, jax.random.key(0), record)["segment_ids"])
  assert ids.shape == (2, q_len) and ids.dtype == np.int32
  np.testing.assert_array_equal(ids[0], ids[1])
  assert np.all(np.diff(ids[0]) >= 0)
  # Every segment non-empty: ids are exactly 0..count-1.
  np.testing.assert_array_equal(np.unique(ids[0]), np.arange(min(3, q_len)))
  if q_len == 349:  # Proportional: 8/4125 of the tokens, then 4096/4125, then 21/4125.
    np.testing.assert_array_equal(np.bincount(ids[0]), [1, 346, 2])
  if q_len == 125:
    np.testing.assert_array_equal(fam.segment_ends(SEGMENTS_4125, 125), [1, 124, 125])


@pytest.mark.parametrize("name", list(RECORDED_AXES))
def test_cpu_axes_keep_structure(name):
  impl = registry.get(name).impl
  for axes in RECORDED_AXES[name]:
    full = {**axes, **CONST_AXES[name]}
    small = impl.cpu_axes(full)
    assert set(small) == set(full)
    assert small["H"] == full["H"] and small["D"] == full["D"]
    assert 1 <= small["B"] <= min(full["B"], 2)
    keys = small.get("Nk", small["Nq"] + small.get("Np", 0))
    assert small["B"] * small["Nq"] * keys <= fam._CPU_PAIR_BUDGET
    for n in ("Nq", "Nk", "Np"):
      if n in full:
        assert 1 <= small[n] <= full[n]
        assert (small[n] % 64 == 0) == (full[n] % 64 == 0), (n, full, small)
        assert small[n] % 128 == 0 or full[n] % 128 != 0
    if "Nk" in full:
      assert (small["Nq"] < small["Nk"]) == (full["Nq"] < full["Nk"])
      assert (small["Nq"] == small["Nk"]) == (full["Nq"] == full["Nk"])
    if name == PREFIX0:
      assert small["Nq"] >= 3


def test_d128_heuristic_and_candidates_follow_the_sm90a_compile():
  """At D=128: 128x128 tiles, 8 warps, 3 stages unless prefix keys need a
  second pipeline (288 KiB); no 128x64 / 4-warp candidate (it spills); no
  candidate over 227 KiB of shared memory. Byte counts as XLA's Triton
  allocated them for sm_90a (`python -m jaxkern.aot`)."""

  def shapes(d, prefix=0, b=4, n=2560):
    s = {"q": jax.ShapeDtypeStruct((b, n, 32, d), jnp.bfloat16), "k": jax.ShapeDtypeStruct((b, n, 32, d), jnp.bfloat16)}
    if prefix:
      s["k_prefix"] = jax.ShapeDtypeStruct((b, prefix, 32, d), jnp.bfloat16)
    return s

  F = fa.FlashAttentionConfig
  assert fa.choose_config(shapes(128)) == F(128, 128, num_warps=8, num_stages=3)
  assert fa.choose_config(shapes(128, prefix=4125, b=1, n=4096)) == F(128, 64, num_warps=8, num_stages=3)
  assert fa.choose_config(shapes(64)) == F(128, 64, num_warps=4, num_stages=3)
  assert fa.shared_memory_bytes(F(128, 128, 8, 3), 128) == 229376
  assert fa.shared_memory_bytes(F(128, 128, 8, 3), 128, has_prefix=True) == 294912
  assert fa.shared_memory_bytes(F(128, 64, 8, 3), 128, has_prefix=True) == 163840
  for s in (shapes(128), shapes(128, prefix=4125, b=1, n=4096)):
    candidates = fa.candidate_configs(s)
    assert F(128, 64, num_warps=4, num_stages=3) not in candidates
    assert all(fa.shared_memory_bytes(c, 128, has_prefix="k_prefix" in s) <= 232448 for c in candidates)
  assert F(128, 128, num_warps=8, num_stages=3) in fa.candidate_configs(shapes(128))
  assert F(128, 64, num_warps=4, num_stages=3) in fa.candidate_configs(shapes(64))


# ---------------------------------------------------------------------------
# Issue 20: empty batches and sequences, a traced scale, hidden NaN/Inf keys.


BACKENDS = ("pallas", "xla")


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_and_sequences(backend):
  q, k, v = qkv(0, 8, 8)
  assert ops.attention(q, k, v, backend=backend).shape == (0, 8, 2, 64)
  kp, vp = normal(1, (0, 3, 2, 64)), normal(2, (0, 3, 2, 64))
  assert ops.prefix_cached_attention(q, k, v, kp, vp, backend=backend).shape == (0, 8, 2, 64)
  assert ops.block_causal_attention(q, k, v, jnp.zeros((0, 8), jnp.int32), backend=backend).shape == (0, 8, 2, 64)
  q, k, v = qkv(2, 0, 5)
  assert ops.attention(q, k, v, backend=backend).shape == (2, 0, 2, 64)
  q, k, v = qkv(2, 5, 0)  # no key: every row is lonely
  np.testing.assert_array_equal(np.asarray(ops.attention(q, k, v, backend=backend), np.float32), 0.0)
  kp, vp = normal(3, (2, 4, 2, 64)), normal(4, (2, 4, 2, 64))  # only prefix keys
  assert_bf16_close(
    ops.prefix_cached_attention(q, k, v, kp, vp, backend=backend),
    numpy_attention(q, kp, vp, np.ones((2, 5, 4), bool), 64**-0.5),
  )


@pytest.mark.parametrize("backend", BACKENDS)
def test_traced_sm_scale_under_jit(backend):
  q, k, v = qkv(1, 20, 30)
  f = jax.jit(lambda q, k, v, scale: ops.attention(q, k, v, sm_scale=scale, backend=backend))
  for scale in (0.5, 0.05):
    assert_bf16_close(f(q, k, v, scale), numpy_attention(q, k, v, np.ones((1, 20, 30), bool), scale))


def poisoned(k, v, key_valid):
  """k and v with NaN and Inf in every key `key_valid` hides."""
  hidden = ~np.asarray(key_valid)[:, :, None, None]
  pattern = np.where(np.arange(k.shape[-1]) % 2, np.nan, np.inf)
  return (jnp.where(hidden, jnp.asarray(pattern, k.dtype), k), jnp.where(hidden, jnp.asarray(-pattern, v.dtype), v))


@pytest.mark.parametrize("backend", BACKENDS)
def test_hidden_keys_never_leak(backend):
  """NaN/Inf in keys and values that `key_valid` hides reach neither the
  output nor any gradient: both equal those with zeros there, and the
  hidden keys' gradients are 0."""
  q, k, v = qkv(2, 20, 50)
  key_valid = jnp.stack([jnp.arange(50) < 37, (jnp.arange(50) % 7) == 3])
  k_bad, v_bad = poisoned(k, v, key_valid)
  hidden = ~np.asarray(key_valid)[:, :, None, None]
  k_zero, v_zero = jnp.where(hidden, 0, k), jnp.where(hidden, 0, v)
  f = lambda q, k, v: ops.attention(q, k, v, key_valid=key_valid, config=SMALL, backend=backend)  # noqa: E731
  out = jax.jit(f)(q, k_bad, v_bad)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(jax.jit(f)(q, k_zero, v_zero), np.float32))
  got = gradients.grads(f, (q, k_bad, v_bad), (0, 1, 2))
  want = gradients.grads(f, (q, k_zero, v_zero), (0, 1, 2))
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
  for g in got[1:]:
    assert np.all(np.asarray(g, np.float32)[np.broadcast_to(hidden, g.shape)] == 0.0)


# ---------------------------------------------------------------------------
# Gradients.

SMALL_BWD = fa.FlashAttentionBwdConfig(32, 16, 16, 32, num_warps=4, num_stages=2)


def kernel_attention(**fixed):
  """The kernel with small forward and backward tiles (many blocks)."""

  def f(q, k, v, *prefix):
    kp, vp = prefix or (None, None)
    return fa.flash_attention(
      q, k, v, k_prefix=kp, v_prefix=vp, config=SMALL, backward_config=SMALL_BWD, interpret=True, **fixed
    )

  return f


def reference_attention(**fixed):
  def f(q, k, v, *prefix):
    kp, vp = prefix or (None, None)
    return fam.attention_reference(q, k, v, k_prefix=kp, v_prefix=vp, **fixed)

  return f


def prefixed(q_len, prefix_len, batch=1):
  q, k, v = qkv(batch, q_len, q_len, head_dim=128)
  return q, k, v, normal(7, (batch, prefix_len, 2, 128)), normal(8, (batch, prefix_len, 2, 128))


GRAD_CASES = {
  "ragged_unmasked": (dict(), lambda: qkv(2, 37, 50)),
  "key_valid_lonely_row_and_hole": (dict(key_valid=_HOLED), lambda: qkv(4, 33, 40)),
  "key_valid_leading_blocks_hidden": (
    dict(key_valid=jnp.stack([jnp.arange(50) >= 37, (jnp.arange(50) % 7) == 3])),
    lambda: qkv(2, 20, 50),
  ),
  "prefix": (dict(), lambda: prefixed(40, 37)),
  "prefix_longer_than_target": (dict(), lambda: prefixed(9, 70)),
  "segments": (dict(segment_ids=ids_from_ends((10, 33, 45), batch=2)), lambda: qkv(2, 45, 45)),
  "unsorted_segments": (
    dict(segment_ids=jnp.asarray(np.random.default_rng(3).integers(0, 4, (2, 50)), jnp.int32)),
    lambda: qkv(2, 50, 50),
  ),
  "everything_and_a_scale": (
    dict(
      key_valid=jnp.arange(45)[None] < jnp.array([[45], [30]]),
      segment_ids=ids_from_ends((10, 33, 45), batch=2),
      sm_scale=0.3,
    ),
    lambda: (*qkv(2, 45, 45), normal(7, (2, 11, 2, 64)), normal(8, (2, 11, 2, 64))),
  ),
}


@pytest.mark.parametrize("label", list(GRAD_CASES))
def test_kernel_gradients_match_xla_under_jit(label):
  fixed, make = GRAD_CASES[label]
  args = make()
  argnums = tuple(range(len(args)))
  got = gradients.grads(kernel_attention(**fixed), args, argnums)
  want = gradients.grads(reference_attention(**fixed), args, argnums)
  gradients.assert_grads_close(got, want, ("dq", "dk", "dv", "dk_prefix", "dv_prefix"))


# The Mosaic GPU forward with the Triton backward (from its o and lse), on
# the cases that exercise each mask and key source.
@pytest.mark.parametrize(
  "label", ["key_valid_lonely_row_and_hole", "prefix", "unsorted_segments", "everything_and_a_scale"]
)
def test_mosaic_gpu_forward_with_triton_backward_matches_xla(label):
  fixed, make = GRAD_CASES[label]
  args = make()
  argnums = tuple(range(len(args)))

  def f(q, k, v, *prefix):
    kp, vp = prefix or (None, None)
    return fa_mosaic.flash_attention(
      q, k, v, k_prefix=kp, v_prefix=vp, backward_config=SMALL_BWD, interpret=True, **fixed
    )

  got = gradients.grads(f, args, argnums)
  want = gradients.grads(reference_attention(**fixed), args, argnums)
  gradients.assert_grads_close(got, want, ("dq", "dk", "dv", "dk_prefix", "dv_prefix"))
  if "key_valid" in fixed:  # hidden keys: exactly zero gradients
    hidden = ~np.asarray(fixed["key_valid"])
    assert all(np.all(np.asarray(g, np.float32)[hidden] == 0.0) for g in got[1:3])


def test_public_ops_gradients_match_xla_under_jit():
  """The three ops on the Pallas path (heuristic tiles) against the XLA
  path, every floating input and the scale, under jit."""
  q, k, v = qkv(2, 20, 20)
  key_valid = jnp.arange(20)[None] < jnp.array([[20], [7]])
  kp, vp = normal(7, (2, 6, 2, 64)), normal(8, (2, 6, 2, 64))
  ids = ids_from_ends((5, 12, 20), batch=2)
  calls = [
    (
      lambda backend: lambda q, k, v, s: ops.attention(q, k, v, key_valid=key_valid, sm_scale=s, backend=backend),
      (q, k, v, jnp.float32(0.2)),
    ),
    (
      lambda backend: (
        lambda q, k, v, kp, vp, s: ops.prefix_cached_attention(q, k, v, kp, vp, sm_scale=s, backend=backend)
      ),
      (q, k, v, kp, vp, jnp.float32(0.125)),
    ),
    (lambda backend: lambda q, k, v: ops.block_causal_attention(q, k, v, ids, backend=backend), (q, k, v)),
  ]
  for op, args in calls:
    argnums = tuple(range(len(args)))
    got = gradients.grads(op("pallas"), args, argnums)
    want = gradients.grads(op("xla"), args, argnums)
    gradients.assert_grads_close(got, want)


def test_masked_gradients_are_exactly_zero():
  """Keys hidden by key_valid get dk = dv = 0; rows that see no key get
  dq = 0 (and so do a key block no query sees)."""
  q, k, v = qkv(4, 33, 40)
  got = gradients.grads(kernel_attention(key_valid=_HOLED), (q, k, v), (0, 1, 2))
  dq, dk, dv = (np.asarray(g, np.float32) for g in got)
  hidden = ~np.asarray(_HOLED)
  assert np.all(dk[hidden] == 0.0) and np.all(dv[hidden] == 0.0)
  assert np.all(dq[1] == 0.0)  # batch row 1 sees no key
  assert np.all(np.abs(dk[0]).max(axis=(1, 2)) > 0)


@pytest.mark.device_stack
def test_gradient_runs_pallas_kernels():
  q, k, v = qkv(1, 20, 20)
  kp, vp = normal(7, (1, 6, 2, 64)), normal(8, (1, 6, 2, 64))
  f = lambda q, k, v, kp, vp: ops.prefix_cached_attention(q, k, v, kp, vp, backend="pallas")  # noqa: E731
  names = gradients.pallas_calls(
    jax.grad(gradients.loss(f, gradients.weights_like(q.shape)), (0, 1, 2, 3, 4)), q, k, v, kp, vp
  )
  assert {"flash_attention_bwd_dq", "flash_attention_bwd_dkdv", "flash_attention_bwd_dkdv_prefix"} <= set(names)


def test_gradients_match_float64_finite_differences():
  """float32 inputs through the kernel (interpret mode, small tiles),
  including the scale, against central differences of float64 numpy
  attention, with a hidden key and a prefix."""
  rng = np.random.default_rng(4)
  q, k, v = (rng.standard_normal((1, n, 1, 16)) for n in (5, 6, 6))
  kp, vp = rng.standard_normal((2, 1, 3, 1, 16))
  key_valid = np.array([[True, True, False, True, True, True]])
  weights = gradients.weights_like(q.shape)
  visible = np.concatenate([np.ones((1, 5, 3), bool), np.broadcast_to(key_valid[:, None], (1, 5, 6))], axis=2)

  def numpy64(q, k, v, kp, vp, scale):
    return numpy_attention(q, np.concatenate([kp, k], 1), np.concatenate([vp, v], 1), visible, float(scale))

  def kernel(q, k, v, kp, vp, scale):
    return fa.flash_attention(
      q,
      k,
      v,
      key_valid=jnp.asarray(key_valid),
      k_prefix=kp,
      v_prefix=vp,
      sm_scale=scale,
      config=SMALL,
      backward_config=SMALL_BWD,
      interpret=True,
    )

  args = [q, k, v, kp, vp, np.array(0.7)]
  got = jax.grad(gradients.loss(kernel, weights), tuple(range(6)))(*(jnp.asarray(a, jnp.float32) for a in args))
  want = gradients.finite_difference_grads(numpy64, args, np.asarray(weights, np.float64))
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=1e-4, atol=1e-4)


def test_query_block_limits_match_brute_force():
  """Per key block, the query blocks outside [first, end) see none of its
  keys; inside, the first and last do (any ids, any key mask)."""
  rng = np.random.default_rng(0)
  n, bq, bk = 77, 16, 8
  for seg in (np.sort(rng.integers(0, 6, (2, n)), axis=1), rng.integers(0, 6, (2, n))):
    key_valid = rng.random((2, n)) < 0.7
    key_valid[1, 8:24] = False  # whole key blocks hidden
    limits = np.asarray(
      keys_lib.query_block_limits(
        jnp.asarray(key_valid), jnp.asarray(seg, jnp.int32), batch=2, q_len=n, kv_len=n, block_q=bq, block_k=bk
      )
    )
    for b in range(2):
      sees = (seg[b][None, :] <= seg[b][:, None]) & key_valid[b][None, :]  # [query, key]
      for j in range(-(-n // bk)):
        blocks = [i for i in range(-(-n // bq)) if sees[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk].any()]
        first, end = limits[b, j]
        if blocks:
          assert first == blocks[0] and end == blocks[-1] + 1, (b, j, limits[b, j], blocks)
        else:
          assert first == end, (b, j, limits[b, j])


def backward_launches(name, axes):
  """The forward (saving lse) and the backward kernels of the heuristic's
  configs at `axes`: dQ per query block, dK/dV per key block (and per
  prefix key block)."""
  a = {**axes, **CONST_AXES[name]}
  kv_len, prefix_len = a.get("Nk", a["Nq"]), a.get("Np", 0)
  config = registry.get(name).choose_config(input_avals(name, axes))
  bwd = fa_bwd.choose_backward_config(
    batch=a["B"], heads=a["H"], q_len=a["Nq"], kv_len=max(kv_len, prefix_len), head_dim=a["D"]
  )
  call = lambda kernel, n, block, c=bwd: TritonCall(
    kernel,
    (-(-n // block), a["B"], a["H"]),
    c.num_warps,  # noqa: E731
    c.num_stages,
  )
  out = [
    call("flash_attention", a["Nq"], config.block_q, config),
    call("flash_attention_bwd_dq", a["Nq"], bwd.block_q_dq),
    call("flash_attention_bwd_dkdv", kv_len, bwd.block_k_dkv),
  ]
  if prefix_len:
    out.append(call("flash_attention_bwd_dkdv_prefix", prefix_len, bwd.block_k_dkv))
  return out


@pytest.mark.parametrize("name,axes", [(n, a) for n, all_axes in LOWERING_AXES.items() for a in all_axes])
def test_backward_lowers_to_its_launches(name, axes):
  avals = input_avals(name, axes)
  names = list(avals)  # every input an argument (masks too); gradients of the floating ones

  def loss(*args):
    x = dict(zip(names, args))
    masks = {k: x[k] for k in ("key_valid", "segment_ids", "k_prefix", "v_prefix") if k in x}
    return jnp.sum(fa.flash_attention(x["q"], x["k"], x["v"], interpret=False, **masks).astype(jnp.float32))

  floating = tuple(i for i, k in enumerate(names) if k in ("q", "k", "v", "k_prefix", "v_prefix"))
  calls = triton_calls(lower_for_h100(jax.grad(loss, floating), *avals.values()))
  assert sorted(calls) == sorted(backward_launches(name, axes))
