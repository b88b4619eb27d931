"""Mixed FP8/FP4 MLA decode (SPEC 4.10): the kit's data (launches; edge
cases for the split+combine kernel in interpret mode: lonely rows,
out-of-range indices, fewer valid indices than slots, shared pages, B = 1,
ragged slot counts, garbage behind invalid indices; lowering at the largest
recorded axes) and the family's own checks: the token record layouts, the
jnp reference against float64 NumPy, the traced scale, the heuristic, input
synthesis. (The checks themselves: test_definitions.py and kit.py.)"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from kit import EVERY_CANDIDATE, Case, MosaicGpuCall, TritonCall
from numerics import assert_bf16_close, assert_f32_close

from jaxkern import quant
from jaxkern.families import mixed_mla as fam
from pallas_kernels.mixed_mla import mosaic_gpu as mm_mosaic
from pallas_kernels.mixed_mla import triton as mk

DEFINITION = "mixed_mla_decode_deepseek41_h64_d512_k8128_k4512"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONST_AXES = dict(P8=256, P4=128, H=64, HKV=1, D=512, K8=128, K4=512, token_bytes_fp8=528, token_bytes_fp4=288)
# The largest recorded axes (datasets/workloads/<DEFINITION>.jsonl).
LOWERING_AXES = [dict(B=1, N8=2, N4=457), dict(B=3, N8=4, N4=146)]
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def load_definition():
  with open(os.path.join(REPO, "datasets", "definitions", DEFINITION + ".json")) as f:
    return json.load(f)


def load_records():
  with open(os.path.join(REPO, "datasets", "workloads", DEFINITION + ".jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


# ---------------------------------------------------------------------------
# Independent float64 NumPy decoding and attention.


def np_fp8_tokens(records):
  records = np.asarray(records)
  d = records.shape[-1] * 128 // 132
  values = records[..., :d].view(ml_dtypes.float8_e4m3fn).astype(np.float64)
  scales = np.ascontiguousarray(records[..., d:]).view("<f4").astype(np.float64)
  return values * np.repeat(scales, 128, axis=-1)


def np_fp4_tokens(records):
  records = np.asarray(records)
  d = records.shape[-1] * 16 // 9
  packed = records[..., : d // 2]
  codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(*packed.shape[:-1], d)
  scales = 2.0 ** (records[..., d // 2 :].astype(np.float64) - 127)
  return E2M1_VALUES[codes] * np.repeat(scales, 16, axis=-1)


def np_reference(q, kv_fp8, indices_fp8, kv_fp4, indices_fp4, sm_scale, attn_sink):
  q = np.asarray(q, np.float64)
  flat8 = np.asarray(kv_fp8).reshape(-1, kv_fp8.shape[-1])
  flat4 = np.asarray(kv_fp4).reshape(-1, kv_fp4.shape[-1])
  sink = np.asarray(attn_sink, np.float64)
  out = np.zeros(q.shape)
  lse = np.full(q.shape[:2], np.inf)
  for b in range(q.shape[0]):
    keys = []
    for idx, flat, decode in ((indices_fp8[b], flat8, np_fp8_tokens), (indices_fp4[b], flat4, np_fp4_tokens)):
      idx = np.asarray(idx)
      idx = idx[(idx >= 0) & (idx < flat.shape[0])]
      keys.append(decode(flat[idx]))
    keys = np.concatenate(keys)
    if not len(keys):
      continue
    logits = q[b] @ keys.T * float(sm_scale)
    m = logits.max(axis=-1, keepdims=True)
    p = np.exp(logits - m)
    lse[b] = m[:, 0] + np.log(p.sum(-1))
    out[b] = (p @ keys) / (p.sum(-1) + np.exp(sink - m[:, 0]))[:, None]
  return out, lse


# ---------------------------------------------------------------------------
# Inputs for kernel tests.


def random_inputs(
  batch,
  heads=16,
  head_dim=256,
  pages8=2,
  page8=16,
  pages4=3,
  page4=8,
  k8=32,
  k4=64,
  seed=0,
  invalid_fraction=0.2,
  pow2_fp8=False,
):
  """Quantized N(0, 1) tokens (f32 FP8 scales by default: not powers of two),
  random indices with about `invalid_fraction` of them -1 or past the cache."""
  rng = np.random.default_rng(seed)
  tokens8 = rng.standard_normal((pages8, page8, 1, head_dim)).astype(np.float32)
  tokens4 = rng.standard_normal((pages4, page4, 1, head_dim)).astype(np.float32)
  rows8, rows4 = pages8 * page8, pages4 * page4

  def indices(rows, k):
    idx = rng.integers(0, rows, (batch, k))
    bad = rng.random((batch, k)) < invalid_fraction
    idx = np.where(bad, rng.choice([-1, -7, rows, rows + 5], (batch, k)), idx)
    return jnp.asarray(idx, jnp.int32)

  return dict(
    q=jnp.asarray(rng.standard_normal((batch, heads, head_dim)), jnp.bfloat16),
    kv_fp8=quant.quantize_mla_fp8_tokens(jnp.asarray(tokens8, jnp.bfloat16), pow2_scales=pow2_fp8),
    indices_fp8=indices(rows8, k8),
    kv_fp4=quant.quantize_mla_fp4_tokens(jnp.asarray(tokens4, jnp.bfloat16)),
    indices_fp4=indices(rows4, k4),
    sm_scale=jnp.asarray(head_dim**-0.5, jnp.float32),
    attn_sink=jnp.asarray(rng.standard_normal(heads), jnp.float32),
  )


SMALL = mk.MixedMlaDecodeConfig(
  split=mk.MixedMlaSplitStage(block_h=16, block_k=16, keys_per_split=32),
  combine=mk.CombineStage(block_h=16, block_d=64),
)


# ---------------------------------------------------------------------------
# Formats and quantizers.


def test_mla_token_record_layouts():
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((3, 512)), jnp.bfloat16)
  rec8 = np.asarray(quant.quantize_mla_fp8_tokens(x, pow2_scales=False))
  assert rec8.shape == (3, 528) and rec8.dtype == np.uint8
  scales = rec8[:, 512:].copy().view("<f4")  # little-endian f32, one per 128 dims
  amax = np.abs(np.asarray(x, np.float32)).reshape(3, 4, 128).max(-1)
  np.testing.assert_allclose(scales, amax / 448, rtol=1e-6)
  np.testing.assert_allclose(np_fp8_tokens(rec8), np.asarray(quant.dequantize_mla_fp8_tokens(rec8)))
  np.testing.assert_allclose(np_fp8_tokens(rec8), np.asarray(x, np.float64), rtol=2**-4, atol=1e-6)
  rec8_pow2 = np.asarray(quant.quantize_mla_fp8_tokens(x))
  s = rec8_pow2[:, 512:].copy().view("<f4")
  assert np.all(np.log2(s) == np.round(np.log2(s))) and np.all(amax / s <= 448)

  rec4 = np.asarray(quant.quantize_mla_fp4_tokens(x))
  assert rec4.shape == (3, 288) and rec4.dtype == np.uint8
  np.testing.assert_array_equal(np_fp4_tokens(rec4), np.asarray(quant.dequantize_mla_fp4_tokens(rec4)))
  # Byte 0 holds dims 0 (low nibble) and 1 (high nibble); byte 256 scales dims 0..15.
  xs = np.asarray(x, np.float64)
  scale0 = 2.0 ** (int(rec4[0, 256]) - 127)
  assert 3 < np.abs(xs[0, :16]).max() / scale0 <= 6
  assert abs(E2M1_VALUES[rec4[0, 0] & 15] * scale0 - xs[0, 0]) <= scale0
  assert abs(E2M1_VALUES[rec4[0, 0] >> 4] * scale0 - xs[0, 1]) <= scale0


# ---------------------------------------------------------------------------
# Reference vs float64 NumPy.


def test_reference_matches_float64_numpy():
  inputs = random_inputs(3, heads=16, head_dim=256, seed=3, invalid_fraction=0.3)
  # Row 1: no valid index at all (a lonely row); row 2: window only.
  inputs["indices_fp8"] = inputs["indices_fp8"].at[1].set(-1)
  inputs["indices_fp4"] = inputs["indices_fp4"].at[1].set(10_000).at[2].set(-1)
  out, lse = fam.mixed_mla_decode_reference(**inputs)
  np_out, np_lse = np_reference(**inputs)
  assert_bf16_close(out, np_out)
  np.testing.assert_allclose(np.asarray(lse, np.float64), np_lse, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(out[1], np.float32) == 0) and np.all(np.isposinf(np.asarray(lse[1])))


def test_reference_sink_only_in_denominator():
  inputs = random_inputs(1, heads=16, head_dim=128, seed=4, invalid_fraction=0.0)
  plain = dict(inputs, attn_sink=jnp.full((16,), -1e4, jnp.float32))  # exp(sink) = 0
  heavy = dict(inputs, attn_sink=jnp.full((16,), 3.0, jnp.float32))
  out0, lse0 = fam.mixed_mla_decode_reference(**plain)
  out1, lse1 = fam.mixed_mla_decode_reference(**heavy)
  np.testing.assert_array_equal(np.asarray(lse0), np.asarray(lse1))  # lse excludes the sink
  factor = 1.0 / (1.0 + np.exp(3.0 - np.asarray(lse0, np.float64)))
  np.testing.assert_allclose(
    np.asarray(out1, np.float64), np.asarray(out0, np.float64) * factor[..., None], rtol=0.02, atol=0.005
  )


# ---------------------------------------------------------------------------
# Kit data: launches, edge cases (kernel in interpret mode vs reference), lowering.


def launches(config, axes):
  """Split programs over (B, key splits of the FP8 then the FP4 slots, head
  blocks x output column blocks), then the shared logsumexp combine
  (`split_kv`) over (head blocks, B, D blocks)."""
  split, combine = config.split, config.combine

  def splits(k):
    keys = min(split.keys_per_split, -(-k // split.block_k) * split.block_k)
    return -(-k // keys)

  column_blocks = axes["D"] // min(split.block_d, axes["D"] & -axes["D"])
  return [
    TritonCall(
      "mixed_mla_decode_split",
      (axes["B"], splits(axes["K8"]) + splits(axes["K4"]), axes["H"] // split.block_h * column_blocks),
      split.num_warps,
      split.num_stages,
    ),
    TritonCall(
      "mixed_mla_decode_combine",
      (
        axes["H"] // min(combine.block_h, axes["H"] & -axes["H"]),
        axes["B"],
        axes["D"] // min(combine.block_d, axes["D"] & -axes["D"]),
      ),
      combine.num_warps,
      combine.num_stages,
    ),
  ]


def launches_mosaic_gpu(config, axes):
  """One Mosaic GPU call, grid (head blocks of 64, key splits, B): q, the
  FP8 records as [N8 * P8, 264] 16-bit words and a zero record, the FP4
  records as [N4 * P4, 288] bytes and a zero record, the slot table (each
  cache's indices padded with -1 to whole blocks) as [B, blocks, block_k],
  the slot block limits, the sinks and the per-head scales in; out and lse
  out, or with splits their fp32 partials (the Triton combine follows)."""
  b, h, d, bk = axes["B"], axes["H"], axes["D"], config.block_k
  rows8, rows4 = axes["N8"] * axes["P8"], axes["N4"] * axes["P4"]
  blocks = -(-axes["K8"] // bk) + -(-axes["K4"] // bk)
  splits = -(-blocks // -(-blocks // config.splits))  # runs of equal length, the last shorter
  words8 = axes["token_bytes_fp8"] // 2
  operands = (
    f"tensor<{b}x{h}x{d}xbf16>",
    f"tensor<{rows8}x{words8}xui16>",
    f"tensor<1x{words8}xui16>",
    f"tensor<{rows4}x{axes['token_bytes_fp4']}xui8>",
    f"tensor<1x{axes['token_bytes_fp4']}xui8>",
    f"tensor<{b}x{blocks}x{bk}xi32>",
    f"tensor<{b}x2xi32>",
    f"tensor<{h}xf32>",
    f"tensor<{h}xf32>",
  )
  if splits == 1:
    return [MosaicGpuCall(operands, (f"tensor<{b}x{h}x{d}xbf16>", f"tensor<{b}x{h}xf32>"))]
  return [MosaicGpuCall(operands, (f"tensor<{b}x{splits}x{h}x{d}xf32>", f"tensor<{b}x{splits}x{h}xf32>"))]


def valid_counts(fp8, fp4):
  def check(out, ref, inputs):
    np.testing.assert_array_equal((np.asarray(inputs["indices_fp8"]) >= 0).sum(1), fp8)
    np.testing.assert_array_equal((np.asarray(inputs["indices_fp4"]) >= 0).sum(1), fp4)

  return check


def b1_every_edge_case():
  """B = 1 at H = 64: in-range, negative and past-the-end indices mixed,
  duplicates (one token twice), fewer valid slots than the split."""
  inputs = random_inputs(
    1, heads=64, head_dim=512, pages8=1, page8=64, pages4=2, page4=32, k8=128, k4=512, seed=5, invalid_fraction=0.5
  )
  inputs["indices_fp4"] = inputs["indices_fp4"].at[0, :8].set(3)
  return inputs


def lonely_and_one_sided_rows(**shape):
  """Row 0: nothing valid (-1 and >= N*P mixed); row 1: only FP8; row 2: only FP4."""
  inputs = random_inputs(4, seed=6, invalid_fraction=0.3, **shape)
  rows8 = inputs["kv_fp8"].shape[0] * inputs["kv_fp8"].shape[1]
  inputs["indices_fp8"] = inputs["indices_fp8"].at[0].set(jnp.where(jnp.arange(32) % 2 == 0, -1, rows8)).at[2].set(-1)
  inputs["indices_fp4"] = inputs["indices_fp4"].at[0].set(-1).at[1].set(-1)
  return inputs


def row_0_lonely(out, ref, inputs):
  out_, lse = out["out"], out["lse"]
  assert np.all(np.asarray(out_[0], np.float32) == 0) and np.all(np.isposinf(np.asarray(lse[0])))
  assert np.all(np.isfinite(np.asarray(lse[1:])))


def garbage_behind_invalid_indices():
  """Row 0 of both caches (where invalid slots are clamped) holds NaN e4m3
  bytes and the invalid-in-UE8M0 scale 255: nothing of it may leak."""
  inputs = random_inputs(2, seed=7, invalid_fraction=0.4)
  inputs["kv_fp8"] = inputs["kv_fp8"].at[0, 0, 0, :].set(0x7F)
  inputs["kv_fp4"] = inputs["kv_fp4"].at[0, 0, 0, :].set(0xFF)
  for name in ("indices_fp8", "indices_fp4"):
    idx = inputs[name]
    inputs[name] = jnp.where(idx == 0, 1, idx)  # row 0 itself is never selected
  return inputs


def shared_pages_ragged_slots():
  """Slot counts that are not multiples of the key step (masked index
  loads); two sequences reading the same tokens; extreme sinks."""
  inputs = random_inputs(2, heads=32, seed=8, k8=24, k4=40, invalid_fraction=0.1)
  inputs["indices_fp4"] = inputs["indices_fp4"].at[1].set(inputs["indices_fp4"][0])
  inputs["indices_fp8"] = inputs["indices_fp8"].at[1, :12].set(inputs["indices_fp8"][0, :12])
  inputs["attn_sink"] = inputs["attn_sink"].at[:4].set(30.0).at[4:8].set(-30.0)
  return inputs


KERNEL_CASES = [
  # The definition's shape (H=64, D=512, 128 + 512 slots), heuristic config;
  # B = 3 with different valid counts: a long sequence, one shorter than
  # the window (100 window tokens, 50 compressed), one with 750 compressed.
  Case(
    DEFINITION,
    dict(B=3, N8=4, N4=20),
    record={"scheduler_sequence_lengths": [35009, 100, 1500]},
    check=valid_counts([128, 100, 128], [512, 50, 512]),
    id="full_shape_synthesized_batch",
  ),
  Case(
    DEFINITION,
    inputs=b1_every_edge_case,
    id="b1_every_edge_case",
    config=mk.MixedMlaDecodeConfig(split=mk.MixedMlaSplitStage(16, 32, 128), combine=mk.CombineStage(16, 128)),
  ),
  Case(DEFINITION, inputs=lonely_and_one_sided_rows, config=SMALL, check=row_0_lonely, id="lonely_and_one_sided"),
  Case(DEFINITION, inputs=garbage_behind_invalid_indices, config=SMALL, id="garbage_behind_invalid_indices"),
  Case(
    DEFINITION,
    inputs=shared_pages_ragged_slots,
    id="shared_pages_ragged_slots",
    config=mk.MixedMlaDecodeConfig(
      split=mk.MixedMlaSplitStage(block_h=32, block_k=16, keys_per_split=16),
      combine=mk.CombineStage(block_h=32, block_d=128),
    ),
  ),
  # The Mosaic GPU kernel (its own checks: test_mixed_mla_mosaic.py): the
  # heuristic splits the keys at these B (10 splits of one slot block),
  # so the edge cases also run unsplit.
  Case(
    DEFINITION,
    dict(B=3, N8=4, N4=20),
    record={"scheduler_sequence_lengths": [35009, 100, 1500]},
    check=valid_counts([128, 100, 128], [512, 50, 512]),
    id="mosaic_full_shape_synthesized_batch",
    backend="mosaic_gpu",
  ),
  *(
    Case(
      DEFINITION, inputs=b1_every_edge_case, config=config, id=f"mosaic_b1_every_edge_case_{tag}", backend="mosaic_gpu"
    )
    for config, tag in [(None, "heuristic"), (mm_mosaic.MosaicMixedMlaConfig(), "unsplit")]
  ),
  Case(
    DEFINITION,
    inputs=functools.partial(lonely_and_one_sided_rows, heads=64, head_dim=512, page8=32, page4=32),
    check=row_0_lonely,
    id="mosaic_lonely_and_one_sided",
    backend="mosaic_gpu",
  ),
]
LOWERING_CASES = [
  Case(DEFINITION, axes, config=EVERY_CANDIDATE, backend=backend)
  for axes in LOWERING_AXES
  for backend in ("triton", "mosaic_gpu")
]
SWEEP_CASE = Case(
  DEFINITION, inputs=lambda: random_inputs(1, heads=16, head_dim=128, k8=16, k4=32, seed=11), id="b1_h16_d128"
)
# The Mosaic GPU kernel takes only H % 64 == 0 at D = 512; 3 slot blocks
# let each split count of its candidates run.
SWEEP_CASE_MOSAIC_GPU = Case(
  DEFINITION,
  inputs=lambda: random_inputs(
    1, heads=64, head_dim=512, pages8=1, page8=64, pages4=2, page4=32, k8=64, k4=100, seed=11
  ),
  id="b1_k8_64_k4_100",
)


# ---------------------------------------------------------------------------
# Precision: FP4 outlier blocks and arbitrary FP8 scales against float64.


def outlier_inputs(batch=2, heads=64, head_dim=512, seed=12):
  """640 visible tokens a row (128 FP8 + 512 FP4, each row of the caches
  once, shuffled). FP4: every 16-dim block spans +-3 (UE8M0 scale 2^-1)
  except two outlier blocks of +-32 / +-48 (scale 2^3: 2^4 above their
  neighbours). FP8: every 128-dim chunk of every token its own magnitude,
  log-uniform over 0.01-100 (scales that are not powers of two). Small q:
  a flat softmax, where the rounding of P over hundreds of keys adds up."""
  rng = np.random.default_rng(seed)
  rows8, rows4 = 128, 512
  tokens8 = rng.standard_normal((rows8, head_dim))
  tokens8 *= np.repeat(np.exp(rng.uniform(np.log(0.01), np.log(100.0), (rows8, head_dim // 128))), 128, -1)
  tokens4 = rng.uniform(-3, 3, (rows4, head_dim))
  tokens4[:, 3::16] = rng.choice([-3.0, 3.0], (rows4, head_dim // 16))  # every block's amax is 3
  for block in (8, 25):
    tokens4[:, 16 * block : 16 * (block + 1)] = rng.choice([-48.0, -32.0, 32.0, 48.0], (rows4, 16))

  def permutations(rows):
    return jnp.asarray(np.stack([rng.permutation(rows) for _ in range(batch)]), jnp.int32)

  return dict(
    q=jnp.asarray(rng.standard_normal((batch, heads, head_dim)) * 0.05, jnp.bfloat16),
    kv_fp8=quant.quantize_mla_fp8_tokens(jnp.asarray(tokens8.reshape(1, rows8, 1, head_dim), jnp.float32)),
    indices_fp8=permutations(rows8),
    kv_fp4=quant.quantize_mla_fp4_tokens(jnp.asarray(tokens4.reshape(4, 128, 1, head_dim), jnp.float32)),
    indices_fp4=permutations(rows4),
    sm_scale=jnp.asarray(576**-0.5, jnp.float32),
    attn_sink=jnp.asarray(rng.standard_normal(heads), jnp.float32),
  )


@pytest.mark.parametrize("launch", [mk.mixed_mla_decode, mm_mosaic.mixed_mla_decode], ids=["triton", "mosaic_gpu"])
def test_kernel_exact_on_fp4_outlier_blocks_and_arbitrary_fp8_scales(launch):
  """Every output within the bf16 tolerance of a float64 computation (P
  carried as bf16 hi + lo into the value dots; with P rounded to bf16 alone
  194 of these 65536 outputs fail, by up to 0.042), and the lse within
  fp32's. Both backends: the Mosaic GPU kernel scales the FP4 values in its
  producer and the FP8 scales on the scores and on P."""
  inputs = outlier_inputs()
  scales = np.unique(np.asarray(inputs["kv_fp4"])[..., 256:])
  assert list(scales) == [126, 130]  # the crafted blocks: 2^-1 and 2^3
  out, lse = launch(**inputs, interpret=True)
  ref_out, ref_lse = np_reference(**inputs)
  err = np.abs(np.asarray(out, np.float64) - ref_out)
  bad = (err > 0.005) & (err > 0.016 * np.abs(ref_out))
  assert not bad.any(), f"{bad.sum()} of {bad.size} outputs off; worst {err[bad].max()}"
  lse_err = np.abs(np.asarray(lse, np.float64) - ref_lse)
  assert np.all((lse_err <= 2e-5) | (lse_err <= 1e-4 * np.abs(ref_lse))), lse_err.max()


# ---------------------------------------------------------------------------
# The traced scale.


def test_kernel_pow2_scales_and_traced_scale_under_jit():
  inputs = random_inputs(1, seed=9, pow2_fp8=True)
  scale = inputs.pop("sm_scale")
  fn = jax.jit(lambda s, **kw: mk.mixed_mla_decode(**kw, sm_scale=s * 2, config=SMALL, interpret=True))
  out, lse = fn(scale, **inputs)
  ref_out, ref_lse = fam.mixed_mla_decode_reference(**inputs, sm_scale=scale * 2)
  assert_bf16_close(out, ref_out)
  assert_f32_close(lse, ref_lse)


# ---------------------------------------------------------------------------
# Configs.


def abstract_inputs(B, N8, N4):
  s = jax.ShapeDtypeStruct
  return dict(
    q=s((B, 64, 512), jnp.bfloat16),
    kv_fp8=s((N8, 256, 1, 528), jnp.uint8),
    indices_fp8=s((B, 128), jnp.int32),
    kv_fp4=s((N4, 128, 1, 288), jnp.uint8),
    indices_fp4=s((B, 512), jnp.int32),
    sm_scale=s((), jnp.float32),
    attn_sink=s((64,), jnp.float32),
  )


@pytest.mark.parametrize("n4", [1, 457])
def test_heuristic_fills_the_gpu_at_b1(n4):
  """Both stages launch a program per SM of an H100/H200 (132) at B = 1,
  and the fp32 partials stay small (<= 10 splits: 1.25 MiB)."""
  config = mk.choose_config(abstract_inputs(1, 2, n4))
  split_call, combine_call = launches(config, dict(CONST_AXES, B=1, N8=2, N4=n4))
  assert np.prod(split_call.grid) >= 132 and np.prod(combine_call.grid) >= 132
  assert split_call.grid[1] <= 10
  large = mk.choose_config(abstract_inputs(24, 8, 400))
  assert large.split.keys_per_split == 128 and large.split.block_d == 512


def test_config_serializes_as_nested_plain_fields():
  import dataclasses

  d = dataclasses.asdict(mk.choose_config(abstract_inputs(3, 4, 146)))
  assert set(d) == {"split", "combine"}
  assert all(isinstance(v, int) for part in d.values() for v in part.values())
  with pytest.raises(ValueError):
    mk.MixedMlaSplitStage(block_h=16, block_k=32, keys_per_split=16)


# ---------------------------------------------------------------------------
# Synthesis and the contract.


def test_synthesis_matches_definition_and_records_structure():
  definition = load_definition()
  record = next(r for r in load_records() if r["axes"]["B"] == 3)
  axes = dict(CONST_AXES, **record["axes"])
  inputs = fam.make_inputs(axes, jax.random.key(1), record)
  for name, spec in definition["inputs"].items():
    shape = tuple(axes[a] for a in spec["shape"]) if spec["shape"] else ()
    assert inputs[name].shape == shape and inputs[name].dtype == jnp.dtype(spec["dtype"]), name
  lengths = record["scheduler_sequence_lengths"]
  idx8, idx4 = np.asarray(inputs["indices_fp8"]), np.asarray(inputs["indices_fp4"])
  assert np.all(idx8 < axes["N8"] * 256) and np.all(idx4 < axes["N4"] * 128)
  assert np.all((idx8 >= 0).sum(1) == 128) and np.all((idx4 >= 0).sum(1) == 512)
  # Windows: consecutive positions, each sequence in its own pages, all N8 pages used.
  for b, n in enumerate(lengths):
    pos = idx8[b] % 256
    assert np.all((np.diff(pos) == 1) | (np.diff(pos) == -255))
    assert pos[-1] == (n - 1) % 256
  assert len(set((idx8 // 256).ravel())) == axes["N8"]
  # Compressed selections: distinct per sequence, pages shared between sequences.
  assert all(len(set(row)) == 512 for row in idx4)
  pages = [set(row // 128) for row in idx4]
  assert pages[0] & pages[1] & pages[2]
  assert len(set().union(*pages)) <= axes["N4"]
  # Real quantized data: decodes finite, N(0, 1)-like.
  keys = np_fp4_tokens(np.asarray(inputs["kv_fp4"])[:4])
  assert np.all(np.isfinite(keys)) and 0.7 < keys.std() < 1.3
  keys8 = np_fp8_tokens(np.asarray(inputs["kv_fp8"])[:1])
  assert 0.8 < keys8.std() < 1.2
  # Deterministic.
  again = fam.make_inputs(axes, jax.random.key(1), record)
  for name in inputs:
    np.testing.assert_array_equal(np.asarray(inputs[name]), np.asarray(again[name]))


@pytest.mark.parametrize("var_axes", [dict(B=1, N8=1, N4=1), dict(B=5, N8=3, N4=7), dict(B=2, N8=1, N4=300)])
def test_synthesis_from_axes_alone(var_axes):
  axes = dict(CONST_AXES, **var_axes)
  inputs = fam.make_inputs(axes, jax.random.key(2), None)
  idx8, idx4 = np.asarray(inputs["indices_fp8"]), np.asarray(inputs["indices_fp4"])
  assert idx8.shape == (axes["B"], 128) and idx4.shape == (axes["B"], 512)
  assert np.all(idx8 < axes["N8"] * 256) and np.all(idx4 < axes["N4"] * 128)
  assert np.all((idx8 >= 0).sum(1) >= 1)
  # -1 padding only at the end of a row.
  for idx in (idx8, idx4):
    valid = idx >= 0
    assert np.all(valid[:, :-1] >= valid[:, 1:])


def test_cpu_axes_keep_structure():
  for record in load_records():
    axes = dict(CONST_AXES, **record["axes"])
    small = fam.cpu_axes(axes)
    assert {k: small[k] for k in ("B", "H", "D", "K8", "K4")} == {k: axes[k] for k in ("B", "H", "D", "K8", "K4")}
    assert 1 <= small["N4"] <= 64 and 1 <= small["N8"] <= 4


def test_ops_entry_point():
  from jaxkern import ops

  inputs = random_inputs(2, heads=16, head_dim=128, seed=10)
  args = [inputs[n] for n in ("q", "kv_fp8", "indices_fp8", "kv_fp4", "indices_fp4", "attn_sink")]
  ref_out, ref_lse = fam.mixed_mla_decode_reference(**inputs)
  out, lse = jax.jit(lambda *a: ops.mixed_mla_decode(*a, backend="xla"))(*args)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref_out, np.float32))
  out, lse = ops.mixed_mla_decode(*args, sm_scale=inputs["sm_scale"], backend="pallas")
  assert_bf16_close(out, ref_out)
  assert_f32_close(lse, ref_lse)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_empty_batch_slots_and_caches(backend):
  """B = 0 gives empty outputs; no FP4 slots (K4 = 0) attends to the FP8
  window alone; an empty FP8 cache (N8 = 0) leaves only the FP4 tokens."""
  from jaxkern import ops

  inputs = random_inputs(2, heads=16, head_dim=128, seed=13)

  def run(**changes):
    args = dict(inputs, **changes)
    out, lse = ops.mixed_mla_decode(
      *(args[n] for n in ("q", "kv_fp8", "indices_fp8", "kv_fp4", "indices_fp4", "attn_sink")),
      sm_scale=args["sm_scale"],
      backend=backend,
    )
    ref_out, ref_lse = np_reference(**args)
    assert out.shape == ref_out.shape and out.dtype == jnp.bfloat16 and lse.shape == ref_lse.shape
    assert_bf16_close(out, ref_out)
    assert_f32_close(lse, ref_lse)

  run(q=inputs["q"][:0], indices_fp8=inputs["indices_fp8"][:0], indices_fp4=inputs["indices_fp4"][:0])
  run(indices_fp4=inputs["indices_fp4"][:, :0])
  run(kv_fp8=inputs["kv_fp8"][:0])
