"""The Mosaic GPU mixed MLA decode (`pallas_kernels.mixed_mla.mosaic_gpu`)
beyond the kit's cases (test_mixed_mla.py: synthesized batch, every edge
case, lonely and one-sided rows, every candidate): the permuted dim order,
what unselected rows hold never reaching an output (the FP4 outlier-scale
precision test runs on both backends in test_mixed_mla.py), a traced scale with dominant sinks over two head groups,
the public op with `backend="mosaic_gpu"`, empty sizes, the refusals, the
heuristic's splits, and synchronization faults the interpreter catches
(its barrier checks, its race detector, on for every run here)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mosaic_faults import assert_interpreter_reports, assert_race_detected
from numerics import assert_bf16_close, assert_f32_close
from test_mixed_mla import random_inputs

from jaxkern import ops
from jaxkern.families import mixed_mla as fam
from pallas_kernels.mixed_mla import mosaic_gpu as mg
from pallas_kernels.shared.kernel import Unsupported

INT32 = np.iinfo(np.int32)
# The kernel's shape (64 heads at D = 512), small caches.
WIDE = dict(heads=64, head_dim=512, pages8=1, page8=64, pages4=2, page4=32)


def check(inputs, *, reference_inputs=None, **kw):
  out, lse = mg.mixed_mla_decode(**inputs, interpret=True, **kw)
  ref_out, ref_lse = fam.mixed_mla_decode_reference(**(reference_inputs or inputs))
  q = inputs["q"]
  assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:2] and lse.dtype == jnp.float32
  assert_bf16_close(out, ref_out)
  assert_f32_close(lse, ref_lse)
  return out, lse


def test_permuted_dims_round_trip_and_pair_each_packed_byte():
  """Chunk j of 64 dims becomes its even dims, then its odd ones; so byte b
  of a chunk's packed FP4 codes holds kernel columns b (low nibble) and 32
  + b (high nibble)."""
  x = jnp.arange(2 * 512).reshape(2, 512)
  permuted = mg.permute_dims(x)
  np.testing.assert_array_equal(mg.unpermute_dims(permuted), x)
  np.testing.assert_array_equal(permuted[0, :64], np.r_[0:64:2, 1:64:2])
  np.testing.assert_array_equal(permuted[1, 64:128], 512 + np.r_[64:128:2, 65:128:2])


def test_unselected_rows_and_extreme_invalid_indices_reach_nothing():
  """NaN e4m3 bytes and the invalid UE8M0 scale 255 in every cache row no
  valid slot selects (row 0 included), invalid indices at the int32
  extremes and just past the end, a lonely sequence: the output is the
  reference's on the clean caches, and finite."""
  clean = random_inputs(3, **WIDE, k8=64, k4=100, seed=1, invalid_fraction=0.3)
  dirty = dict(clean)
  for name, rows, garbage in (("8", 64, 0x7F), ("4", 64, 0xFF)):
    idx = np.asarray(clean[f"indices_fp{name}"])
    idx = np.where(idx >= 0, np.clip(idx, 1, rows // 2 - 1), idx)  # valid slots select rows 1 .. rows/2 - 1
    idx[0, :3] = [INT32.max, INT32.min, rows * (2 if name == "4" else 1)]
    idx[2] = -1  # lonely
    clean[f"indices_fp{name}"] = dirty[f"indices_fp{name}"] = jnp.asarray(idx, jnp.int32)
    cache = np.asarray(clean[f"kv_fp{name}"]).copy()
    flat = cache.reshape(-1, cache.shape[-1])
    flat[0] = garbage
    flat[rows // 2 :] = garbage
    dirty[f"kv_fp{name}"] = jnp.asarray(cache)
  out, lse = check(dirty, reference_inputs=clean, config=mg.MosaicMixedMlaConfig(splits=2))
  assert np.isfinite(np.asarray(out, np.float32)).all()
  np.testing.assert_array_equal(np.asarray(out[2], np.float32), 0.0)
  assert np.isposinf(np.asarray(lse[2])).all() and np.isfinite(np.asarray(lse[:2])).all()


def test_traced_scale_dominant_sinks_and_two_head_groups():
  """sm_scale traced under jit; sinks that dominate or vanish from the
  denominator; H = 128 (two CTAs per sequence), unsplit."""
  inputs = random_inputs(1, **dict(WIDE, heads=128), k8=40, k4=90, seed=2)
  inputs["attn_sink"] = inputs["attn_sink"].at[:8].set(30.0).at[8:16].set(-30.0)
  scale = inputs.pop("sm_scale")
  config = mg.MosaicMixedMlaConfig()
  f = jax.jit(lambda s: mg.mixed_mla_decode(**inputs, sm_scale=s * 2, config=config, interpret=True))
  out, lse = f(scale)
  ref_out, ref_lse = fam.mixed_mla_decode_reference(**inputs, sm_scale=scale * 2)
  assert_bf16_close(out, ref_out)
  assert_f32_close(lse, ref_lse)


def test_public_op_runs_the_mosaic_gpu_kernel():
  inputs = random_inputs(1, **WIDE, k8=30, k4=70, seed=3)
  scale, sink = inputs.pop("sm_scale"), inputs.pop("attn_sink")
  out, lse = ops.mixed_mla_decode(**inputs, attn_sink=sink, sm_scale=scale, backend="mosaic_gpu")
  ref_out, ref_lse = fam.mixed_mla_decode_reference(**inputs, sm_scale=scale, attn_sink=sink)
  assert_bf16_close(out, ref_out)
  assert_f32_close(lse, ref_lse)


def test_empty_sizes():
  """B = 0 launches nothing; no FP8 slots (and an FP4 cache of one page)
  runs the FP4 blocks alone; no slots at all gives 0 and +inf."""
  inputs = random_inputs(2, **WIDE, k8=64, k4=64, seed=4)
  out, lse = mg.mixed_mla_decode(
    **{
      **inputs,
      "q": inputs["q"][:0],
      "indices_fp8": inputs["indices_fp8"][:0],
      "indices_fp4": inputs["indices_fp4"][:0],
    },
    interpret=True,
  )
  assert out.shape == (0, 64, 512) and lse.shape == (0, 64)
  check({**inputs, "indices_fp8": inputs["indices_fp8"][:, :0]})
  out, lse = mg.mixed_mla_decode(
    **{**inputs, "indices_fp8": inputs["indices_fp8"][:, :0], "indices_fp4": inputs["indices_fp4"][:, :0]},
    interpret=True,
  )
  np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)
  assert np.isposinf(np.asarray(lse)).all()


@pytest.mark.parametrize(
  "heads,dim,dtype,match",
  [
    (16, 512, jnp.bfloat16, "H=16 must be a multiple of 64"),
    (64, 256, jnp.bfloat16, "head dim D=256"),
    (64, 512, jnp.float32, "must be bfloat16"),
  ],
)
def test_inputs_it_does_not_take_are_unsupported(heads, dim, dtype, match):
  inputs = random_inputs(1, **dict(WIDE, heads=heads, head_dim=dim), k8=8, k4=8)
  with pytest.raises(Unsupported, match=match):
    mg.mixed_mla_decode(**{**inputs, "q": inputs["q"].astype(dtype)}, interpret=True)


def test_bad_input_and_a_config_over_shared_memory_are_refused():
  inputs = random_inputs(1, **WIDE, k8=8, k4=8)
  with pytest.raises(ValueError, match=r"attn_sink \(63,\) \[64\]"):
    mg.mixed_mla_decode(**{**inputs, "attn_sink": inputs["attn_sink"][:63]}, interpret=True)
  with pytest.raises(ValueError, match="bytes of shared memory"):
    mg.mixed_mla_decode(**inputs, config=mg.MosaicMixedMlaConfig(stages=2), interpret=True)


def test_shared_memory_of_one_ring_slot_fits_at_the_recorded_slots_and_two_do_not():
  slots = 128 + 512
  assert (
    mg.shared_memory_bytes(mg.MosaicMixedMlaConfig(), slots)
    <= 232448
    < mg.shared_memory_bytes(mg.MosaicMixedMlaConfig(stages=2), slots)
  )


@pytest.mark.parametrize(
  "batch,k8,k4,splits",
  [
    (1, 128, 512, 10),
    (3, 128, 512, 10),
    (20, 128, 512, 5),
    (66, 128, 512, 2),
    (132, 128, 512, 1),
    (1, 64, 64, 2),
    (1, 128, 200, 6),
  ],
)
def test_heuristic_splits_keys_below_a_wave(batch, k8, k4, splits):
  """132 SMs, 10 slot blocks at the recorded 128 + 512 slots: B <= 13 takes
  10 splits of one block, B = 20 six (runs of 2 blocks: 5 splits), 66 two,
  132 none; fewer blocks cap the splits (2 + 4 blocks: 6)."""
  shapes = {
    "q": jax.ShapeDtypeStruct((batch, 64, 512), jnp.bfloat16),
    "indices_fp8": jax.ShapeDtypeStruct((batch, k8), jnp.int32),
    "indices_fp4": jax.ShapeDtypeStruct((batch, k4), jnp.int32),
  }
  assert mg.choose_config(shapes).splits == splits


def fault_inputs():
  """The problem the fault tests break: 4 steps through 1 ring slot."""
  return random_inputs(1, **WIDE, k8=128, k4=128, seed=5, invalid_fraction=0.0)


def fault_launch(fault):
  """The launch with `fault` on the fault problem (a thunk for `mosaic_faults`)."""
  inputs = fault_inputs()
  return lambda: mg._forward(**inputs, config=mg.MosaicMixedMlaConfig(), interpret=True, fault=fault)


@pytest.mark.device_stack  # the GPU machine's Mosaic GPU too
def test_correct_protocol_on_the_fault_problem():
  """The shipped protocol on the problem the faults below break: the
  reference's output, and nothing for the race detector."""
  check(fault_inputs(), config=mg.MosaicMixedMlaConfig())


@pytest.mark.device_stack  # the GPU machine's Mosaic GPU too
@pytest.mark.parametrize(
  "fault,match",
  [
    # The ring slot released by one consumer: the producer refills it under
    # the other one's wgmmas; the release phases run ahead of their waiter.
    # (The race detector sees the consumers' loads of the slot's scale
    # table, not their wgmma reads of its keys; the phase check fires first.)
    ("release_once", "phase"),
    # The staging barrier completing one copy early: the producer would
    # dequantize a half-gathered step; the late arrivals are left over.
    # (The race detector cannot see it: the interpreter copies when a TMA
    # is issued, and the wait joins every arrival made by then.)
    ("staged_short", "arrivals pending"),
  ],
)
def test_broken_synchronization_is_caught(fault, match):
  assert_interpreter_reports(fault_launch(fault), match)


@pytest.mark.device_stack  # the GPU machine's Mosaic GPU too
def test_staged_records_read_before_they_land_are_caught_by_the_race_detector():
  """The producer dequantizing the staging buffer before it waits on
  `staged`: the records are there in the interpreter (it runs each gather
  when it is issued) and the phases stay in step, so only the race
  detector catches it (test_sparse_mla_mosaic.py shows the output right
  without it, for the same producer loop)."""
  assert_race_detected(fault_launch("staged_late"), mg.__name__)
