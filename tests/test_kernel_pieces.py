"""Tests of the pieces the kernel families share: declared config rules
(errors name class, field, value and rule; every config class round-trips
through JSON), the device's SM count (default without a GPU, read from the
device with one, used by the heuristics), the base-2 online-softmax step and
its finishing helpers against a plain softmax, and the split-KV combine
(interpret mode) against a float64 NumPy combine on random partials with
empty splits, lonely rows and sinks."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import assert_bf16_close, assert_f32_close

import pallas_kernels
from jaxkern import tuning
from pallas_kernels.dense_gemm import triton as dense_gemm
from pallas_kernels.flash_attention import triton as flash_attention
from pallas_kernels.gdn_decode import triton as gdn_decode
from pallas_kernels.gdn_prefill import triton as gdn_prefill
from pallas_kernels.grouped_gemm import triton as grouped_gemm
from pallas_kernels.mixed_mla import triton as mixed_mla
from pallas_kernels.neighborhood_attention import triton as neighborhood_attention
from pallas_kernels.qsa_index import triton as qsa_index
from pallas_kernels.shared import config_rules, device, split_kv
from pallas_kernels.shared.lowering import assert_lowers_to_triton
from pallas_kernels.shared.online_softmax import (
  LOG2_E,
  init_carry,
  lse_base2,
  lse_natural,
  normalize,
  online_softmax_step,
  row_sums,
)


def all_config_classes() -> list[type]:
  classes = set()
  for info in pkgutil.walk_packages(pallas_kernels.__path__, "pallas_kernels."):
    module = importlib.import_module(info.name)
    classes.update(
      v
      for v in vars(module).values()
      if isinstance(v, type) and issubclass(v, config_rules.KernelConfig) and v is not config_rules.KernelConfig
    )
  return sorted(classes, key=lambda c: c.__name__)


# ---------------------------------------------------------------------------
# Config rules.


def test_every_config_class_is_a_frozen_validated_dataclass_that_round_trips():
  classes = all_config_classes()
  assert len(classes) >= 17, [c.__name__ for c in classes]
  for cls in classes:
    config = cls()
    assert dataclasses.is_dataclass(config) and cls.__dataclass_params__.frozen, cls
    with pytest.raises(dataclasses.FrozenInstanceError):
      setattr(config, dataclasses.fields(config)[0].name, None)
    assert tuning.config_from_json(tuning.config_to_json(config), config) == config, cls
    for f in dataclasses.fields(config):  # every field states its rules
      assert f.metadata.get("rules"), f"{cls.__name__}.{f.name}"


@pytest.mark.parametrize(
  "make,message",
  [
    (lambda: dense_gemm.DenseGemmConfig(block_m=96), "DenseGemmConfig.block_m=96 must be a power of two >= 16"),
    (lambda: dense_gemm.DenseGemmConfig(block_k=8), "DenseGemmConfig.block_k=8 must be a power of two >= 16"),
    (lambda: dense_gemm.DenseGemmConfig(group_m=0), "DenseGemmConfig.group_m=0 must be an int >= 1"),
    (lambda: dense_gemm.DenseGemmConfig(num_warps=6), "DenseGemmConfig.num_warps=6 must be a power of two >= 1"),
    (lambda: dense_gemm.DenseGemmConfig(num_stages=0), "DenseGemmConfig.num_stages=0 must be an int >= 1"),
    # JSON can carry floats and bools: neither is an int block size.
    (
      lambda: flash_attention.FlashAttentionConfig(block_q=64.0),
      "FlashAttentionConfig.block_q=64.0 must be a power of two >= 16",
    ),
    (
      lambda: flash_attention.FlashAttentionConfig(num_warps=True),
      "FlashAttentionConfig.num_warps=True must be a power of two >= 1",
    ),
    (lambda: grouped_gemm.GroupedGemmConfig(block_k=16), "GroupedGemmConfig.block_k=16 must be one of (32, 64, 128)"),
    (
      lambda: gdn_prefill.GdnPrefillConfig(dot_precision="fp8"),
      "GdnPrefillConfig.dot_precision='fp8' must be one of ('bf16x3', 'bf16')",
    ),
    (lambda: qsa_index.SelectStage(block_keys=24), "SelectStage.block_keys=24 must be a power of two >= 16"),
    (
      lambda: qsa_index.ScoreStage(block_keys=256, chunk_keys=128),
      "ScoreStage.chunk_keys=128 must be a multiple of block_keys",
    ),
    (
      lambda: split_kv.SplitStage(block_k=32, keys_per_split=16),
      "SplitStage.keys_per_split=16 must be a multiple of block_k",
    ),
    (lambda: split_kv.CombineStage(block_d=8), "CombineStage.block_d=8 must be a power of two >= 16"),
    (
      lambda: mixed_mla.MixedMlaDecodeConfig(split={"block_h": 16}),
      "MixedMlaDecodeConfig.split={'block_h': 16} must be a MixedMlaSplitStage",
    ),
    (
      lambda: neighborhood_attention.NeighborhoodAttentionConfig(block_t=1, block_y=2, block_x=4),
      "NeighborhoodAttentionConfig.block_queries=8 must be an int >= 16",
    ),
    (
      lambda: neighborhood_attention.NeighborhoodAttentionConfig(block_t=3),
      "NeighborhoodAttentionConfig.block_t=3 must be a power of two >= 1",
    ),
  ],
)
def test_a_broken_rule_names_class_field_value_and_rule(make, message):
  with pytest.raises(ValueError) as info:
    make()
  assert str(info.value) == message


def test_replace_and_json_check_the_rules_too():
  config = dense_gemm.DenseGemmConfig()
  with pytest.raises(ValueError, match=r"DenseGemmConfig.block_n=100 must be"):
    dataclasses.replace(config, block_n=100)
  stage = mixed_mla.MixedMlaSplitStage()
  with pytest.raises(ValueError, match=r"MixedMlaSplitStage.block_h=8 must be a power of two >= 16"):
    tuning.config_from_json({"split": {"block_h": 8}}, mixed_mla.MixedMlaDecodeConfig(split=stage))


def test_a_field_without_rules_is_a_programming_error():
  @dataclasses.dataclass(frozen=True)
  class Unruled(config_rules.KernelConfig):
    block: int = 16

  with pytest.raises(TypeError, match="Unruled.block declares no rule"):
    Unruled()


def test_rules_read_other_fields_safely():
  rule = config_rules.multiple_of("block")
  assert rule.holds(64, types.SimpleNamespace(block=16))
  assert not rule.holds(24, types.SimpleNamespace(block=16))
  assert not rule.holds(64, types.SimpleNamespace(block=0))  # no ZeroDivisionError
  assert not rule.holds(64, types.SimpleNamespace(block="16"))


# ---------------------------------------------------------------------------
# Device facts.


@pytest.fixture
def fresh_sm_count():
  device.num_sms.cache_clear()
  yield
  device.num_sms.cache_clear()


def test_sm_count_default_without_gpu(fresh_sm_count):
  assert device.DEFAULT_NUM_SMS == 132
  assert not any(d.platform == "gpu" for d in jax.devices())
  assert device.num_sms() == device.DEFAULT_NUM_SMS


@pytest.mark.parametrize(
  "attributes,expected",
  [
    ({"core_count": 114}, 114),  # an H100 PCIe
    ({"core_count": 132}, 132),
    ({}, device.DEFAULT_NUM_SMS),  # not reported: the default
    ({"core_count": 0}, device.DEFAULT_NUM_SMS),
  ],
)
def test_sm_count_is_read_from_the_gpu(monkeypatch, fresh_sm_count, attributes, expected):
  gpu = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 PCIe", **attributes)
  monkeypatch.setattr(device, "has_gpu", lambda: True)
  monkeypatch.setattr(device.jax, "devices", lambda backend=None: [gpu])
  assert device.num_sms() == expected


def test_heuristics_size_their_grids_by_the_sm_count(monkeypatch, fresh_sm_count):
  """GDN decode at B=16 (16 x 8 heads): 128-row blocks give 128 programs,
  enough for 64 SMs, while 132 SMs want 2 x 132 and get 32-row blocks."""
  shapes = {"state": jax.ShapeDtypeStruct((16, 8, 128, 128), jnp.float32)}
  assert gdn_decode.choose_config(shapes).block_v == 32
  monkeypatch.setattr(gdn_decode, "num_sms", lambda: 64)
  assert gdn_decode.choose_config(shapes).block_v == 128


# ---------------------------------------------------------------------------
# Online softmax (plain jnp: the step is the same code inside kernels).


def softmax_reference(s, v, visible, sink=None):
  """float64 softmax over visible keys; (out, natural lse); lonely rows 0 / +inf."""
  s = np.where(visible, np.asarray(s, np.float64), -np.inf)
  m = s.max(axis=1, keepdims=True)
  p = np.where(visible, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
  l = p.sum(axis=1)
  denominator = l + (
    0.0 if sink is None else np.exp(np.asarray(sink, np.float64) - np.where(np.isfinite(m[:, 0]), m[:, 0], 0.0))
  )
  out = np.where(l[:, None] > 0, p @ np.asarray(v, np.float64) / np.where(l > 0, denominator, 1.0)[:, None], 0.0)
  lse = np.where(l > 0, np.log(np.where(l > 0, l, 1.0)) + np.where(np.isfinite(m[:, 0]), m[:, 0], 0.0), np.inf)
  return out, lse


def test_online_step_matches_a_plain_softmax_over_blocks():
  rng = np.random.default_rng(0)
  rows, keys, width, block = 8, 48, 16, 16
  s = rng.standard_normal((rows, keys)).astype(np.float32) * 4
  v = rng.standard_normal((keys, width)).astype(np.float32)
  visible = rng.random((rows, keys)) < 0.6
  visible[1] = False  # a lonely row
  visible[2, :block] = False  # a row that sees nothing in the first block
  visible[:, 16:32] = False  # a block nobody sees
  sink = rng.standard_normal(rows).astype(np.float32)
  carry = init_carry(rows, width)
  for start in range(0, keys, block):
    cols = slice(start, start + block)
    carry = online_softmax_step(
      jnp.asarray(s[:, cols]) * LOG2_E, carry, jnp.asarray(v[cols]), visible=jnp.asarray(visible[:, cols])
    )
  acc, m, l = carry
  for with_sink in (False, True):
    want_out, want_lse = softmax_reference(s, v, visible, sink if with_sink else None)
    out = normalize(acc, m, l, jnp.asarray(sink) if with_sink else None)
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=2e-5, atol=2e-6)
  assert_f32_close(lse_natural(m, l), want_lse)
  assert_f32_close(lse_base2(m, l), np.where(np.isinf(want_lse), -np.inf, want_lse * LOG2_E))
  assert np.all(np.asarray(out)[1] == 0) and np.isposinf(np.asarray(lse_natural(m, l))[1])


def test_online_step_unmasked_blocks_and_value_parts():
  """Without `visible` every row must see the whole block; the value
  dimension in parts gives what one tile gives; value scales multiply the
  probabilities of their part (as scaling that part's values would)."""
  rng = np.random.default_rng(1)
  s = jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((32, 8)), jnp.float32)
  plain = online_softmax_step(s, init_carry(4, 8), v)
  parts = online_softmax_step(s, init_carry(4, 4, parts=2), [v[:, :4], v[:, 4:]])
  # Tolerances of SPEC 5 (f32): the two forms may sum in different orders.
  assert_f32_close(plain[0], np.concatenate([np.asarray(a) for a in parts[0]], 1))
  want, _ = softmax_reference(np.asarray(s) / LOG2_E, v, np.ones((4, 32), bool))
  assert_f32_close(normalize(*plain), want)
  w = jnp.asarray(rng.random(32) + 0.5, jnp.float32)
  scaled = online_softmax_step(s, init_carry(4, 4, parts=2), [v[:, :4], v[:, 4:]], value_scales=[w, None])
  assert_f32_close(scaled[0][0], online_softmax_step(s, init_carry(4, 4), v[:, :4] * w[:, None])[0])
  assert_f32_close(scaled[0][1], parts[0][1])
  # Infinite scores under a mask are selected away, never multiplied by 0.
  s_inf = s.at[:, 0].set(jnp.inf)
  masked = online_softmax_step(s_inf, init_carry(4, 8), v, visible=jnp.arange(32)[None, :] > 0)
  assert np.all(np.isfinite(np.asarray(normalize(*masked))))


def test_online_step_raw_scores_dot_row_sums_and_finite_max():
  """The options a kernel's inner loop may take give the plain step's
  softmax: `score_scale` (raw scores, the max scaled after), row sums as a
  dot of the bf16-rounded probabilities (exactly the weights the value dot
  used), a finite starting max (no empty-row guard: a block hiding all of
  a row's keys leaves it unchanged, infinite hidden scores included)."""
  rng = np.random.default_rng(3)
  rows, keys, width, block = 16, 64, 16, 16
  s = rng.standard_normal((rows, keys)).astype(np.float32) * 4
  v = rng.standard_normal((keys, width)).astype(np.float32)
  visible = rng.random((rows, keys)) < 0.6
  visible[:, :block] = False  # nobody sees the first block
  visible[3, block : 2 * block] = False  # row 3 sees nothing in the second either
  visible[:, 0] = False
  s[:, 0] = np.inf  # hidden infinities are selected away
  visible[:, -1] = True  # every row sees a key
  v16 = jnp.asarray(v, jnp.bfloat16)
  plain = init_carry(rows, width)
  fused = init_carry(rows, width, row_sums_by_dot=True, finite_max=True)
  assert fused[2].shape == (rows, 16) and np.isfinite(np.asarray(fused[1])).all()
  for start in range(0, keys, block):
    cols = slice(start, start + block)
    vis = jnp.asarray(visible[:, cols])
    plain = online_softmax_step(jnp.asarray(s[:, cols]) * LOG2_E, plain, v16[cols], visible=vis)
    fused = online_softmax_step(
      jnp.asarray(s[:, cols]), fused, v16[cols], visible=vis, score_scale=LOG2_E, row_sums_by_dot=True, finite_max=True
    )
  acc, m, l = fused
  want, _ = softmax_reference(s, v16.astype(jnp.float32), visible)
  np.testing.assert_allclose(np.asarray(normalize(acc, m, row_sums(l))), want, rtol=2e-2, atol=2e-3)
  assert_f32_close(m, plain[1])
  assert np.all(np.asarray(l) == np.asarray(l)[:, :1])  # equal columns
  # One block whose probabilities all round down in bf16 (0.998 -> 0.99609):
  # the dot's row sum is the rounded weights' sum, 0.2% below the fp32 one.
  raw = np.full((2, 16), np.log2(0.998) / LOG2_E, np.float32)
  raw[:, 0] = 0.0
  _, _, l_dot = online_softmax_step(
    jnp.asarray(raw),
    init_carry(2, width, row_sums_by_dot=True, finite_max=True),
    v16[:16],
    score_scale=LOG2_E,
    row_sums_by_dot=True,
    finite_max=True,
  )
  weights = np.exp2(raw * LOG2_E)
  rounded = np.asarray(jnp.asarray(weights).astype(jnp.bfloat16).astype(jnp.float32)).sum(1)
  np.testing.assert_allclose(np.asarray(row_sums(l_dot)), rounded, rtol=1e-6)
  assert np.all(np.abs(np.asarray(row_sums(l_dot)) - weights.sum(1)) > 1e-3 * weights.sum(1))
  with pytest.raises(ValueError, match="one value tile"):
    online_softmax_step(jnp.asarray(s[:, :block]), fused, [v16[:block]], row_sums_by_dot=True)


def test_online_step_p_hi_lo_carries_about_16_bits_of_p():
  """bf16 values (exact), a flat softmax over 640 keys: P rounded to bf16
  alone is off by ~2^-9 relative per term; as hi + lo the sum matches
  float64 to fp32-accumulation level."""
  rng = np.random.default_rng(2)
  s = rng.standard_normal((16, 640)).astype(np.float32) * 0.3
  v = (rng.choice([-96.0, -64.0, 64.0, 96.0], (640, 32))).astype(np.float32)
  want, _ = softmax_reference(s, v, np.ones(s.shape, bool))
  errors = []
  for p_hi_lo in (False, True):
    carry = init_carry(16, 32)
    for start in range(0, 640, 64):
      carry = online_softmax_step(
        jnp.asarray(s[:, start : start + 64]) * LOG2_E,
        carry,
        jnp.asarray(v[start : start + 64], jnp.bfloat16),
        p_hi_lo=p_hi_lo,
      )
    errors.append(np.abs(np.asarray(normalize(*carry), np.float64) - want).max())
  assert errors[1] < 2e-4 < errors[0] and errors[1] < errors[0] / 20, errors


# ---------------------------------------------------------------------------
# Split-KV combine (interpret mode) vs a float64 NumPy combine.


def combine_reference(o_part, lse_part, sink=None):
  """float64, natural log: out = sum_s e^(lse_s - m) o_s / (sum_s e^(lse_s - m) + e^(sink - m))."""
  lse = np.asarray(lse_part, np.float64) / LOG2_E  # base 2 -> natural
  m = lse.max(axis=1, keepdims=True)  # [R, 1, H]
  m0 = np.where(np.isfinite(m), m, 0.0)
  w = np.exp(lse - m0)  # 0 for empty splits
  total = w.sum(axis=1)  # [R, H]
  numerator = np.einsum("rsh,rshd->rhd", w, np.asarray(o_part, np.float64))
  denominator = total + (0.0 if sink is None else np.exp(np.asarray(sink, np.float64)[None] - m0[:, 0]))
  seen = total > 0
  out = np.where(seen[..., None], numerator / np.where(seen, denominator, 1.0)[..., None], 0.0)
  return out, np.where(seen, m0[:, 0] + np.log(np.where(seen, total, 1.0)), np.inf)


def random_partials(rows, splits, heads, head_dim, seed):
  rng = np.random.default_rng(seed)
  o_part = rng.standard_normal((rows, splits, heads, head_dim)).astype(np.float32)
  lse_part = (rng.standard_normal((rows, splits, heads)) * 6).astype(np.float32)
  empty = rng.random((rows, splits, heads)) < 0.3
  empty[:, splits // 2] = True  # an all-empty split
  empty[0, :, :3] = True  # lonely rows: every split empty
  o_part[empty] = 0.0  # what a split kernel writes there
  lse_part[empty] = -np.inf
  return jnp.asarray(o_part), jnp.asarray(lse_part)


@pytest.mark.parametrize(
  "rows,splits,heads,head_dim,stage",
  [
    (3, 5, 32, 64, split_kv.CombineStage(block_h=16, block_d=32)),
    (2, 1, 24, 48, split_kv.CombineStage()),  # one split; blocks fitted to 8 heads, 16 columns
    (2, 7, 16, 128, split_kv.CombineStage(block_h=4, block_d=128, num_warps=2)),
  ],
)
@pytest.mark.parametrize("with_sink", [False, True])
def test_combine_matches_numpy(rows, splits, heads, head_dim, stage, with_sink):
  o_part, lse_part = random_partials(rows, splits, heads, head_dim, seed=rows * splits + heads)
  sink = jnp.asarray(np.random.default_rng(9).standard_normal(heads) * 3, jnp.float32) if with_sink else None
  if sink is not None:
    sink = sink.at[0].set(30.0).at[1].set(-30.0)  # extreme sinks
  out, lse = split_kv.combine_splits(
    o_part, lse_part, sink, stage=stage, out_dtype=jnp.bfloat16, with_lse=True, name="test_combine", interpret=True
  )
  want_out, want_lse = combine_reference(o_part, lse_part, sink)
  assert out.shape == (rows, heads, head_dim) and out.dtype == jnp.bfloat16
  assert_bf16_close(out, want_out)
  lonely = np.isposinf(want_lse)
  assert lonely[0, :3].all()
  np.testing.assert_array_equal(np.isposinf(np.asarray(lse)), lonely)
  assert np.all(np.asarray(out, np.float32)[lonely] == 0)
  np.testing.assert_allclose(np.asarray(lse)[~lonely], want_lse[~lonely], rtol=1e-5, atol=1e-5)
  only_out = split_kv.combine_splits(
    o_part, lse_part, sink, stage=stage, out_dtype=jnp.float32, name="test_combine", interpret=True
  )
  np.testing.assert_allclose(np.asarray(only_out), want_out, rtol=1e-5, atol=1e-6)


def test_combine_rejects_mismatched_partials():
  o_part, lse_part = random_partials(2, 3, 16, 32, seed=0)
  with pytest.raises(ValueError, match=r"lse_part \(2, 2, 16\) does not match o_part"):
    split_kv.combine_splits(
      o_part, lse_part[:, :2], stage=split_kv.CombineStage(), out_dtype=jnp.bfloat16, name="x", interpret=True
    )
  with pytest.raises(ValueError, match=r"sink \(8,\) must be \[16\]"):
    split_kv.combine_splits(
      o_part, lse_part, jnp.zeros(8), stage=split_kv.CombineStage(), out_dtype=jnp.bfloat16, name="x", interpret=True
    )


def test_fit_combine_divides_the_problem():
  stage = split_kv.CombineStage(block_h=16, block_d=128)
  assert split_kv.fit_combine(stage, 64, 512) == stage
  assert split_kv.fit_combine(stage, 12, 96) == split_kv.CombineStage(block_h=4, block_d=32)


@pytest.mark.parametrize(
  "rows, heads, head_dim, splits, target",
  [
    (1, 64, 512, 10, 132),  # mixed MLA at B = 1: the smallest tile, 256 programs
    (3, 64, 512, 5, 132),  # 8 heads x 32 columns, 384 programs
    (64, 64, 512, 3, 132),  # the largest tile reaches the target
    (1, 4, 32, 1, 132),  # under the target anyway: the smallest tile, fitted
  ],
)
def test_choose_combine_fills_the_target_with_the_largest_tile(rows, heads, head_dim, splits, target):
  stage = split_kv.choose_combine(rows, heads, head_dim, splits, target)
  programs = split_kv.combine_programs(stage, rows, heads, head_dim)
  tiles = [split_kv.fit_combine(split_kv.CombineStage(h, d, w), heads, head_dim) for h, d, w in split_kv._COMBINE_TILES]
  larger = tiles[: [(t.block_h, t.block_d) for t in tiles].index((stage.block_h, stage.block_d))]
  assert programs >= target or (stage.block_h, stage.block_d) == (tiles[-1].block_h, tiles[-1].block_d)
  assert all(split_kv.combine_programs(t, rows, heads, head_dim) < target for t in larger)
  assert stage.block_s <= min(4, split_kv.next_pow2(splits))
  values = stage.block_s * stage.block_h * stage.block_d // (32 * stage.num_warps)
  assert values <= split_kv._COMBINE_VALUES_PER_THREAD


def test_combine_lowers_for_h100():
  s = jax.ShapeDtypeStruct
  avals = (s((4, 20, 64, 512), jnp.float32), s((4, 20, 64), jnp.float32), s((64,), jnp.float32))
  txt = assert_lowers_to_triton(
    lambda o, l, sink: split_kv.combine_splits(
      o, l, sink, stage=split_kv.CombineStage(), with_lse=True, out_dtype=jnp.bfloat16, name="combine", interpret=False
    ),
    *avals,
  )
  assert txt.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.slow  # a subprocess: the first jit of a fresh process
def test_the_first_jitted_kernel_of_a_process_compiles_once():
  """pallas_kernels registers Pallas's fuser flag on import: without it the
  first jitted Pallas call changed its own jit cache key and compiled twice."""
  import pathlib
  import subprocess
  import sys

  program = (
    "import jax, jax.numpy as jnp\n"
    "from pallas_kernels.dense_gemm import triton as dense_gemm\n"
    "f = jax.jit(lambda a, b: dense_gemm.dense_gemm_nt(a, b, interpret=True))\n"
    "a = jnp.ones((16, 32), jnp.bfloat16)\n"
    "f(a, a); f(a, a)\n"
    "print(f._cache_size())\n"
  )
  repo = pathlib.Path(__file__).resolve().parent.parent
  env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(repo), "JAX_PLATFORMS": "cpu"}
  p = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  assert p.stdout.split()[-1] == "1", p.stdout
