"""FP8 x FP4 grouped GEMM: the kit's data (launches; the edge cases of issue
11 for the kernel in interpret mode: decode M = 6 with six experts, one-row
experts, group boundaries inside a row tile, -1 padding rows, ragged M/N/K;
lowering of every candidate at decode M = 6) and the family's own checks:
the in-kernel e2m1 decode, the work list, the reference vs float64 NumPy,
synthesis, cpu_axes, the heuristic. (The checks themselves:
test_definitions.py and kit.py.)"""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkern import quant
from jaxkern.families import grouped_gemm as fam
from kit import EVERY_CANDIDATE, Case, TritonCall
from pallas_kernels import fp_formats
from pallas_kernels import grouped_gemm as gg

# The Triton-lowering DeprecationWarning is expected (SPEC 2); pytest resets
# the process-wide filter per test.

DATASETS = pathlib.Path(__file__).resolve().parent.parent / "datasets"
DEFINITIONS = ("grouped_gemm_fp8_fp4_e384_n4608_k5120_g32", "grouped_gemm_fp8_fp4_e384_n5120_k2304_g32")
E = 384
RECORDED_M = (6, 12, 18, 768, 2688, 11904, 14592, 17664, 20736, 24192, 24576)
LARGEST_M = max(RECORDED_M)
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def definition(name):
  return json.loads((DATASETS / "definitions" / f"{name}.json").read_text(encoding="utf-8"))


def const_axes(name):
  return {k: v["value"] for k, v in definition(name)["axes"].items() if v["type"] == "const"}


def operands(ids, n, k, e, seed=0):
  """Quantized random operands for the given expert ids (list, -1 allowed)."""
  ka, kb = jax.random.split(jax.random.key(seed))
  m = len(ids)
  a, a_scale = quant.quantize_fp8_e4m3(jax.random.normal(ka, (m, k)) * 2.0, 32)
  # Weights with per-row magnitude spread so the scale bytes vary.
  w = jax.random.normal(kb, (e, n, k)) * jnp.exp(jax.random.normal(kb, (e, n, 1))) / np.sqrt(k)
  b, b_scale = quant.quantize_e2m1(w, 32)
  return dict(a=a, a_scale=a_scale, b=b, b_scale=b_scale, expert_ids=jnp.asarray(ids, jnp.int32))


def grouped(sizes, pad_to=1):
  """Expert ids for groups {expert: rows}, each group padded with -1 rows to
  a multiple of `pad_to` (DeepGEMM's contiguous layout)."""
  ids = []
  for expert, rows in sizes:
    ids += [expert] * rows + [-1] * (-rows % pad_to)
  return ids


SMALL = gg.GroupedGemmConfig(16, 32, 64, num_warps=4, num_stages=2)
CASES = {
    # One decode token: six different experts, six rows in one tile.
    "decode_six_experts": ([1, 4, 5, 9, 12, 15], 96, 128, None),
    # Three decode tokens sharing experts (M = 18), one-row experts included.
    "decode_three_tokens": (grouped([(0, 2), (3, 1), (4, 3), (7, 2), (8, 1), (9, 3), (13, 4), (15, 2)]), 80, 96, None),
    # Group boundaries inside 16-row tiles, experts of one row, a ragged
    # last tile (M = 37), N and K not block multiples (K = 96: block_k 32).
    "boundaries_in_tiles": (grouped([(0, 1), (2, 5), (3, 1), (5, 17), (6, 1), (9, 12)]), 40, 96, SMALL),
    # DeepGEMM-style padding: every group padded with -1 rows to 16, so a
    # whole tile is padding; plus a padding tail.
    "padded_groups": (grouped([(1, 3), (2, 16), (4, 5), (7, 1)], pad_to=16) + [-1] * 19, 32, 64, SMALL),
    # Padding rows in the middle of a tile shared by two experts.
    "padding_inside_tile": ([2, 2, -1, -1, 3, 3, 3, -1, 5, -1, -1, 6, 6, 6, 6, -1, 7, 7, -1], 48, 64, SMALL),
    "one_row": ([3], 16, 32, None),
    "all_padding": ([-1] * 20, 32, 32, SMALL),
    # A larger tile: 32-row tiles over 70 rows, 8-warp config shape.
    "block_m_32": (grouped([(e, r) for e, r in enumerate([5, 9, 1, 14, 3, 20, 2, 16])]), 64, 128,
                   gg.GroupedGemmConfig(32, 64, 128, num_warps=4, num_stages=3)),
}


def launches(config, axes):
  """Grid (N blocks, work items): every row tile once, plus one item per
  further expert a tile holds (at most min(E, M) - 1 in all)."""
  m = axes["M"]
  items = -(-m // config.block_m) + max(min(axes["E"], m), 1) - 1
  return [TritonCall("grouped_gemm_fp8_fp4", (-(-axes["N"] // config.block_n), items, 1), config.num_warps,
                     config.num_stages)]


def padding_rows_are_zero(ids):
  def check(out, ref, inputs):
    pad = np.asarray(ids) < 0
    assert (np.asarray(out["C"], np.float32)[pad] == 0).all()
    assert np.abs(np.asarray(ref["C"], np.float32)[~pad]).max(initial=1) > 0.1
  return check


KERNEL_CASES = [
    Case(DEFINITIONS[0], inputs=lambda ids=ids, n=n, k=k: operands(ids, n, k, e=16, seed=len(ids)), config=config,
         check=padding_rows_are_zero(ids), id=label)
    for label, (ids, n, k, config) in sorted(CASES.items())]
LOWERING_CASES = [Case(name, {"M": 6}, config=EVERY_CANDIDATE, id="decode_m6") for name in DEFINITIONS]
SWEEP_CASE = Case(DEFINITIONS[0], {"M": 18, "E": 16, "N": 64, "K": 128, "K_groups": 4, "K_packed": 64})


def test_kernel_e2m1_decode_is_fp_formats_exactly():
  packed = jnp.arange(256, dtype=jnp.uint8)
  even, odd = gg.e2m1_bytes_to_f32(packed)
  for got, codes in zip((even, odd), fp_formats.unpack_e2m1(packed)):
    want = np.asarray(fp_formats.e2m1_to_f32(codes))
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.signbit(np.asarray(got)), np.signbit(want))  # -0.0 kept


def work_items(ids, e, block_m):
  tile, expert, first = (np.asarray(x) for x in gg.build_work_list(jnp.asarray(ids, jnp.int32), e, block_m))
  return tile, expert, first


@pytest.mark.parametrize("seed", range(6))
def test_work_list_covers_every_row_once_within_its_bound(seed):
  rng = np.random.default_rng(seed)
  e, block_m = 12, 16
  sizes = [(x, int(rng.integers(1, 20))) for x in sorted(rng.choice(e, size=int(rng.integers(1, e)), replace=False))]
  ids = grouped(sizes, pad_to=int(rng.choice([1, 4, 16])))
  ids = ids + [-1] * int(rng.integers(0, 20))
  tile, expert, first = work_items(ids, e, block_m)
  assert len(tile) == gg.work_list_length(len(ids), e, block_m) == -(-len(ids) // block_m) + min(e, len(ids)) - 1
  ids = np.asarray(ids)
  written = np.zeros(len(ids), int)
  for t, x, f in zip(tile, expert, first):
    rows = np.arange(t * block_m, min((t + 1) * block_m, len(ids)))
    if x >= 0:
      written[rows[ids[rows] == x]] += 1
    if f:
      written[rows[ids[rows] == -1]] += 1
  np.testing.assert_array_equal(written, 1)
  # Each tile's items: one "first", experts ascending; unused entries are no-ops.
  real = (expert >= 0) | (first == 1)
  assert real[:real.sum()].all() and not real[real.sum():].any()
  assert (np.diff(tile[real]) >= 0).all()
  assert first[real].sum() == -(-len(ids) // block_m)


def test_decode_work_list_is_one_item_per_expert_not_per_expert_id():
  # M = 6 at E = 384: one tile, six items; the grid never spans the experts.
  ids = [3, 77, 120, 200, 301, 383]
  tile, expert, first = work_items(ids, E, 16)
  assert list(expert) == ids and list(tile) == [0] * 6 and list(first) == [1, 0, 0, 0, 0, 0]
  assert gg.work_list_length(6, E, 16) == 6
  assert gg.work_list_length(LARGEST_M, E, 64) == LARGEST_M // 64 + E - 1


def reference_float64(a, a_scale, b, b_scale, expert_ids):
  """Independent float64 NumPy: table-decoded e2m1, np.ldexp scales."""
  a64 = np.asarray(a.astype(jnp.float32), np.float64)
  a64 = np.ldexp(a64, np.repeat(np.asarray(a_scale, np.int64) - 127, 32, axis=1))
  packed = np.asarray(b)
  codes = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), np.int64)
  codes[..., 0::2] = packed & 15
  codes[..., 1::2] = packed >> 4
  w64 = np.ldexp(E2M1[codes], np.repeat(np.asarray(b_scale, np.int64) - 127, 32, axis=-1))
  ids = np.asarray(expert_ids)
  out = np.zeros((a64.shape[0], w64.shape[1]))
  for i, x in enumerate(ids):
    if x >= 0:
      out[i] = w64[x] @ a64[i]
  return out


def test_reference_matches_float64():
  inputs = operands(grouped([(0, 3), (2, 1), (5, 4)]) + [-1, -1], 24, 96, e=6, seed=7)
  c = fam.grouped_gemm_fp8_fp4_reference(**inputs)
  expected = reference_float64(**inputs)
  assert c.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(c, np.float64), expected, rtol=2**-8, atol=1e-6)
  assert (np.asarray(c, np.float32)[-2:] == 0).all()


def test_reference_windows_and_unsorted_rows(monkeypatch):
  ids = grouped([(1, 7), (2, 1), (4, 11), (5, 3)], pad_to=4)
  inputs = operands(ids, 16, 64, e=6, seed=9)
  whole = np.asarray(fam.grouped_gemm_fp8_fp4_reference(**inputs), np.float32)
  monkeypatch.setattr(fam, "_REFERENCE_WINDOW", 4)  # windows overlap at the end of M
  np.testing.assert_array_equal(np.asarray(fam.grouped_gemm_fp8_fp4_reference(**inputs), np.float32), whole)
  # Rows in any order still give each row its expert's product.
  perm = np.random.default_rng(0).permutation(len(ids))
  shuffled = {k: (v[perm] if k in ("a", "a_scale", "expert_ids") else v) for k, v in inputs.items()}
  np.testing.assert_array_equal(np.asarray(fam.grouped_gemm_fp8_fp4_reference(**shuffled), np.float32),
                                whole[perm])


def test_make_inputs_deterministic_and_realistic():
  axes = {**const_axes(DEFINITIONS[0]), "E": 16, "N": 64, "K": 128, "K_groups": 4, "K_packed": 64, "M": 96}
  x = fam.make_inputs(axes, jax.random.key(0), None)
  y = fam.make_inputs(axes, jax.random.key(0), None)
  z = fam.make_inputs(axes, jax.random.key(1), None)
  assert set(x) == {"a", "a_scale", "b", "b_scale", "expert_ids"}
  shapes = {"a": ((96, 128), jnp.float8_e4m3fn), "a_scale": ((96, 4), jnp.uint8), "b": ((16, 64, 64), jnp.uint8),
            "b_scale": ((16, 64, 4), jnp.uint8), "expert_ids": ((96,), jnp.int32)}
  for key, (shape, dtype) in shapes.items():
    assert x[key].shape == shape and x[key].dtype == dtype, key
    np.testing.assert_array_equal(np.asarray(x[key].view(jnp.uint8) if key == "a" else x[key]),
                                  np.asarray(y[key].view(jnp.uint8) if key == "a" else y[key]))
  assert not np.array_equal(np.asarray(x["expert_ids"]), np.asarray(z["expert_ids"]))
  ids = np.asarray(x["expert_ids"])
  # Grouped (sorted), no padding (recorded M = 6 x tokens), 16 tokens x 6
  # distinct experts: no expert has more rows than tokens; skewed loads.
  assert (np.diff(ids) >= 0).all() and (ids >= 0).all() and (ids < 16).all()
  counts = np.bincount(ids, minlength=16)
  assert counts.max() <= 16 and counts.sum() == 96 and counts.max() > 6
  # Experts nobody uses hold quantized zeros; used ones realistic scales.
  unused = counts == 0
  assert (np.asarray(x["b"])[unused] == 0).all() and (np.asarray(x["b_scale"])[unused] == 127).all()
  scales = np.asarray(x["b_scale"])[~unused]
  assert (scales > 0).all() and (scales < 255).all()
  ref = np.asarray(fam.grouped_gemm_fp8_fp4_reference(**x), np.float32)
  assert 0.7 < ref.std() < 1.3  # O(1) outputs: unit activations, N(0, 1/K) weights
  a_deq = np.asarray(quant.dequantize_fp8_e4m3(x["a"], x["a_scale"], 32))
  assert 0.9 < a_deq.std() < 1.1


def test_make_inputs_uses_the_records_sequences():
  name = DEFINITIONS[1]
  lines = (DATASETS / "workloads" / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
  decode3 = next(json.loads(l) for l in lines if json.loads(l)["axes"]["M"] == 18)
  assert len(decode3["scheduler_sequence_lengths"]) == 3
  assert fam._sequence_count(decode3, 3) == 3
  assert fam._sequence_count(None, 3) == 1
  assert fam._sequence_count({"scheduler_sequence_lengths": [5] * 40}, 16) == 16  # scaled run: capped
  axes = fam.cpu_axes({**const_axes(name), **decode3["axes"]})
  with_record = fam.make_inputs(axes, jax.random.key(0), decode3)
  ids = np.asarray(with_record["expert_ids"])
  assert ids.shape == (18,) and (np.diff(ids) >= 0).all()
  # 3 tokens of 6 distinct experts each: no expert more than 3 rows.
  assert np.bincount(ids).max() <= 3


@pytest.mark.parametrize("name", DEFINITIONS)
def test_make_inputs_full_size_is_abstract_and_bounded(name):
  axes = {**const_axes(name), "M": LARGEST_M}
  full = jax.eval_shape(lambda key: fam.make_inputs(axes, key, None), jax.random.key(0))
  assert full["b"].shape == (E, axes["N"], axes["K"] // 2)
  assert full["a"].shape == (LARGEST_M, axes["K"]) and full["a"].dtype == jnp.float8_e4m3fn


def test_cpu_axes():
  for name in DEFINITIONS:
    const = const_axes(name)
    for m in RECORDED_M:
      small = fam.cpu_axes({**const, "M": m})
      assert small["E"] == 16 and small["M"] == min(m, 96) and small["M"] % 6 == 0
      assert small["N"] <= 768 and small["K"] <= 768 and small["K"] % 32 == 0
      assert small["K_groups"] * 32 == small["K"] and small["K_packed"] * 2 == small["K"]
  assert fam.cpu_axes({**const_axes(DEFINITIONS[1]), "M": 6})["K"] == 576  # 2304 / 4: not a power of two


def test_heuristic():
  def shapes(m):
    return {"a": jax.ShapeDtypeStruct((m, 5120), jnp.float8_e4m3fn),
            "b": jax.ShapeDtypeStruct((E, 4608, 2560), jnp.uint8)}
  assert gg.choose_config(shapes(6)).block_m == 16
  assert gg.choose_config(shapes(768)).block_m == 16
  assert gg.choose_config(shapes(24576)).block_m == 64
  for m in RECORDED_M:
    assert gg.choose_config(shapes(m)) in gg.candidate_configs(shapes(m))


def test_config_rejects_bad_blocks():
  with pytest.raises(ValueError):
    gg.GroupedGemmConfig(block_m=48)
  with pytest.raises(ValueError):
    gg.GroupedGemmConfig(block_k=16)
