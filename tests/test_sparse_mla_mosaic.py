"""The Mosaic GPU sparse MLA prefill (`pallas_kernels.sparse_mla.mosaic_gpu`)
beyond the kit's cases (test_sparse_mla.py: ragged slot blocks, edge rows,
records, every candidate): what invalid slots hold never reaches an output
and is never read, the half-slot consumers' exchange of row maxima and
sums (and the consumers that score every slot on the same inputs), a
traced scale and dominant sinks, the public op with `backend="mosaic_gpu"`,
the refusals, and synchronization faults the interpreter catches (its
barrier checks, its race detector, on for every run here)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mosaic_faults import assert_interpreter_reports, assert_race_detected, results_without_race_detection
from numerics import assert_bf16_close, assert_f32_close

from jaxkern import ops
from jaxkern.families import sparse_mla as fam
from pallas_kernels.shared.kernel import Unsupported
from pallas_kernels.shared.lowering import lower_for_h100
from pallas_kernels.sparse_mla import mosaic_gpu as mg

INT32 = np.iinfo(np.int32)


def problem(m, nkv, topk, *, heads=64, dim=512, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((m, heads, dim), np.float32), jnp.bfloat16)
  kv = jnp.asarray(rng.standard_normal((nkv, 1, dim), np.float32), jnp.bfloat16)
  idx = rng.integers(-2, nkv + 2, (m, 1, topk)).astype(np.int32)
  sink = jnp.asarray(rng.uniform(-2, 4, heads), jnp.float32)
  return q, kv, idx, dim**-0.5, sink


def check(q, kv, idx, scale, sink, *, reference_kv=None, **kw):
  out, lse = mg.sparse_mla_prefill(q, kv, jnp.asarray(idx), scale, sink, interpret=True, **kw)
  ref_out, ref_lse = fam.sparse_mla_prefill_reference(
    q, kv if reference_kv is None else reference_kv, jnp.asarray(idx), scale, sink
  )
  assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:2] and lse.dtype == jnp.float32
  assert_bf16_close(out, ref_out)
  assert_f32_close(lse, ref_lse)
  return out, lse


def test_unselected_rows_and_extreme_invalid_indices_reach_nothing():
  """NaN and Inf in every workspace row no valid slot selects (row 0
  included), invalid indices at the int32 extremes and just past the end,
  a lonely row: the output is the reference's on the clean workspace, and
  finite."""
  q, kv, idx, scale, sink = problem(4, 200, 130, seed=1)
  idx = np.where(idx % 3 == 0, -1, np.clip(idx, 1, 99))  # valid slots select rows 1..99
  idx[0, 0, :5] = [INT32.max, INT32.min, 200, 201, -7]
  idx[3] = INT32.max  # lonely
  poison = np.zeros((200, 1, 1), bool)
  poison[0] = poison[100:] = True
  dirty = jnp.where(
    jnp.asarray(poison), jnp.asarray(np.where(np.arange(200) % 2, np.inf, np.nan))[:, None, None], kv
  ).astype(kv.dtype)
  out, lse = check(q, dirty, idx, scale, sink, reference_kv=kv)
  assert np.isfinite(np.asarray(out, np.float32)).all()
  np.testing.assert_array_equal(np.asarray(out[3], np.float32), 0.0)
  assert np.isposinf(np.asarray(lse[3])).all() and np.isfinite(np.asarray(lse[:3])).all()


@pytest.mark.parametrize("half_slots", [True, False])
def test_each_consumer_half_alone_and_maxima_from_the_other_half(half_slots):
  """Half-slot consumers (and, the same inputs, both scoring every slot):
  a row whose valid slots are all in the first half of every step, one
  with all in the second, one alternating halves from step to step (each
  consumer sees steps with nothing of its own), and a lonely row. Peaked
  scores (scale 0.25) put a row's maximum in one half at a time, so a
  consumer scaling its P by its own half's maximum would overflow or lose
  the other half; the row sums of the two halves are added once, at the
  end."""
  q, kv, idx, _, sink = problem(4, 300, 192, seed=7)
  idx = np.clip(idx, 0, 299)
  slot = np.arange(192)
  first_half = slot % 64 < 32
  idx[0, 0, ~first_half] = -1
  idx[1, 0, first_half] = 300
  idx[2, 0, first_half == ((slot // 64) % 2 == 0)] = INT32.min
  idx[3] = -1
  out, lse = check(q, kv, idx, 0.25, sink, config=mg.MosaicSparseMlaConfig(half_slots=half_slots))
  assert np.isfinite(np.asarray(lse[:3])).all() and np.isposinf(np.asarray(lse[3])).all()


def test_traced_scale_dominant_sinks_and_two_head_groups():
  """sm_scale traced under jit; sinks that dominate or vanish from the
  denominator; H = 128 (two CTAs per row) at D = 256 through a 3-slot ring."""
  q, kv, idx, _, sink = problem(3, 90, 200, heads=128, dim=256, seed=2)
  sink = sink.at[:8].set(30.0).at[8:16].set(-30.0)
  config = mg.MosaicSparseMlaConfig(stages=3)
  f = jax.jit(lambda s: mg.sparse_mla_prefill(q, kv, jnp.asarray(idx), s, sink, config=config, interpret=True))
  out, lse = f(jnp.float32(0.07))
  ref_out, ref_lse = fam.sparse_mla_prefill_reference(q, kv, jnp.asarray(idx), 0.07, sink)
  assert_bf16_close(out, ref_out)
  assert_f32_close(lse, ref_lse)


def test_public_op_runs_the_mosaic_gpu_kernel():
  q, kv, idx, scale, sink = problem(2, 70, 64, seed=3)
  out, lse = ops.sparse_mla_prefill(q, kv, jnp.asarray(idx), sink, sm_scale=scale, backend="mosaic_gpu")
  ref_out, ref_lse = fam.sparse_mla_prefill_reference(q, kv, jnp.asarray(idx), scale, sink)
  assert_bf16_close(out, ref_out)
  assert_f32_close(lse, ref_lse)


def test_empty_sizes():
  q, kv, idx, scale, sink = problem(0, 10, 64)
  out, lse = mg.sparse_mla_prefill(q, kv, jnp.asarray(idx), scale, sink, interpret=True)
  assert out.shape == (0, 64, 512) and lse.shape == (0, 64)
  q, kv, idx, scale, sink = problem(2, 10, 0)
  out, lse = mg.sparse_mla_prefill(q, kv, jnp.asarray(idx), scale, sink, interpret=True)
  np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)
  assert np.isposinf(np.asarray(lse)).all()


@pytest.mark.parametrize(
  "heads,dim,dtype,match",
  [
    (32, 512, jnp.bfloat16, "H=32 must be a multiple of 64"),
    (64, 128, jnp.bfloat16, "head dim D=128"),
    (64, 512, jnp.float32, "must be bfloat16"),
  ],
)
def test_inputs_it_does_not_take_are_unsupported(heads, dim, dtype, match):
  q, kv, idx, scale, sink = problem(1, 10, 16, heads=heads, dim=dim)
  with pytest.raises(Unsupported, match=match):
    mg.sparse_mla_prefill(q.astype(dtype), kv.astype(dtype), jnp.asarray(idx), scale, sink, interpret=True)


def test_bad_input_and_a_config_over_shared_memory_are_refused():
  q, kv, idx, scale, sink = problem(1, 10, 16)
  with pytest.raises(ValueError, match=r"attn_sink \(63,\) must be \[64\]"):
    mg.sparse_mla_prefill(q, kv, jnp.asarray(idx), scale, sink[:63], interpret=True)
  with pytest.raises(ValueError, match="shared memory at D=512"):
    mg.sparse_mla_prefill(
      q, kv, jnp.asarray(idx), scale, sink, config=mg.MosaicSparseMlaConfig(stages=2), interpret=True
    )


def test_shared_memory_of_one_ring_slot_fits_at_the_largest_topk_and_two_do_not():
  assert (
    mg.shared_memory_bytes(mg.MosaicSparseMlaConfig(), 512, 640)
    <= 232448
    < mg.shared_memory_bytes(mg.MosaicSparseMlaConfig(stages=2), 512, 128)
  )


@pytest.mark.parametrize("half_slots", [True, False])
def test_shared_memory_bytes_is_what_mosaic_gpu_allocates(half_slots):
  """Two ring slots do not fit: the H100 lowering refuses them, naming the
  bytes it would allocate, which `shared_memory_bytes` predicts exactly."""
  config = mg.MosaicSparseMlaConfig(stages=2, half_slots=half_slots)
  avals = (
    jax.ShapeDtypeStruct((2, 64, 512), jnp.bfloat16),
    jax.ShapeDtypeStruct((300, 1, 512), jnp.bfloat16),
    jax.ShapeDtypeStruct((2, 1, 640), jnp.int32),
    jax.ShapeDtypeStruct((), jnp.float32),
    jax.ShapeDtypeStruct((64,), jnp.float32),
  )
  with pytest.raises(Exception, match=rf"smem_bytes={mg.shared_memory_bytes(config, 512, 640)} >"):
    lower_for_h100(mg._forward, *avals, config=config, interpret=False)


@pytest.mark.parametrize(
  "m,topk,splits",
  [(4096, 640, 1), (128, 128, 1), (66, 640, 2), (40, 640, 3), (16, 640, 4), (1, 128, 2), (1, 64, 1), (3, 300, 3)],
)
def test_heuristic_splits_topk_only_below_half_a_wave(m, topk, splits):
  """132 SMs: 128 CTAs are not split; 66 take 2, 40 take 3, fewer take 4
  (or as many as there are slot blocks, in runs without an empty one: 5
  blocks in 4 splits are runs of 2, 2, 1)."""
  shapes = {
    "q": jax.ShapeDtypeStruct((m, 64, 512), jnp.bfloat16),
    "indices": jax.ShapeDtypeStruct((m, 1, topk), jnp.int32),
  }
  assert mg.choose_config(shapes).splits == splits


def test_split_rows_with_empty_runs_and_lonely_rows():
  """4 splits over 10 slot blocks (runs 3, 3, 3, 1): a row whose valid
  slots end in the first run (the other splits write empty partials), a
  lonely row, a row whose only valid slot is the very last."""
  q, kv, idx, scale, sink = problem(4, 500, 640, seed=5)
  idx[0, 0, 100:] = -1
  idx[1] = -1
  idx[2] = -1
  idx[2, 0, -1] = 17
  out, lse = check(q, kv, idx, scale, sink, config=mg.MosaicSparseMlaConfig(splits=4))
  np.testing.assert_array_equal(np.asarray(out[1], np.float32), 0.0)
  assert np.isposinf(np.asarray(lse[1])).all()


FAULT_PROBLEM = dict(m=1, nkv=300, topk=256, seed=4)  # 4 steps through 1 ring slot


def fault_launch(fault):
  """The launch with `fault` on the fault problem (a thunk for
  `mosaic_faults`), and the problem's inputs."""
  q, kv, idx, scale, sink = problem(**FAULT_PROBLEM)
  idx = jnp.asarray(np.clip(idx, 0, FAULT_PROBLEM["nkv"] - 1))

  def launch():
    return mg._forward(q, kv, idx, scale, sink, config=mg.MosaicSparseMlaConfig(), interpret=True, fault=fault)

  return launch, (q, kv, idx, scale, sink)


@pytest.mark.device_stack  # the GPU machine's Mosaic GPU too
def test_correct_protocol_on_the_fault_problem():
  """The shipped protocol on the problem the faults below break: the
  reference's output, and nothing for the race detector."""
  launch, args = fault_launch(None)
  out, lse = launch()
  ref_out, ref_lse = fam.sparse_mla_prefill_reference(*args)
  assert_bf16_close(out, ref_out)
  assert_f32_close(lse, ref_lse)


@pytest.mark.device_stack  # the GPU machine's Mosaic GPU too
@pytest.mark.parametrize(
  "fault,match",
  [
    # The ring slot released by one consumer: the producer refills it under
    # the other one's wgmmas; the release phases run ahead of their waiter.
    # (The race detector cannot see it: the consumers read the ring by wgmma.)
    ("release_once", "phase"),
    # The staging barrier completing one copy early: the producer would copy
    # a half-gathered step into the ring; the late arrivals are left over.
    # (Nor this: the interpreter copies when a TMA is issued, and the wait
    # joins every arrival made by then, the late one's too.)
    ("staged_short", "arrivals pending"),
    # The half-slot consumers' row-maxima rendezvous completing on one
    # arrival: a consumer would read the other's maxima before they are
    # written; the other then waits on a phase already past.
    ("exchange_once", "phase"),
  ],
)
def test_broken_synchronization_is_caught(fault, match):
  assert_interpreter_reports(fault_launch(fault)[0], match)


@pytest.mark.device_stack  # the GPU machine's Mosaic GPU too
def test_staged_rows_read_before_they_land_only_the_race_detector_catches():
  """The producer copying the staging buffer into the ring before it waits
  on `staged` (after it instead): the interpreter runs each gather when it
  is issued, so the rows are there and the output is right, and the phases
  stay in step; the race detector reports the reads against the gathers'
  writes."""
  launch, args = fault_launch("staged_late")
  out, lse = results_without_race_detection(launch)
  ref_out, ref_lse = fam.sparse_mla_prefill_reference(*args)
  assert_bf16_close(out, ref_out)
  assert_f32_close(lse, ref_lse)
  assert_race_detected(launch, mg.__name__)
