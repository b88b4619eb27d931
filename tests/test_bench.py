"""Timing (`jaxkern.bench`) and trace reading (`jaxkern.profile_events`):
the GPU path's event selection and per-call arithmetic on a synthetic trace
with a GPU's plane and line names, and the whole profiler path on real
XLA:CPU traces (XLA:CPU's events are on the `/host:CPU` plane)."""

import jax
import jax.numpy as jnp
import pytest
from jax.profiler import ProfileData

from jaxkern import bench
from jaxkern import profile_events as pe

# The device timer is what the GPU run measures with: these run in the
# device-stack lane too.
pytestmark = pytest.mark.device_stack

# Event names of the synthetic GPU trace: a Pallas kernel (XLA suffixes a
# repeated name), XLA glue, and the separator's own fusion.
NAMES = {1: "dense_gemm_nt", 2: "dense_gemm_nt_1", 3: "loop_convert_fusion", 4: "loop_add_fusion"}
MODULES = {10: "jit_op", 11: f"jit_{pe.SEPARATOR}", 12: f"jit_{pe.FLUSH}"}


def _event(meta, start_us, dur_us, module=None):
  stat = f" stats {{ metadata_id: 100 ref_value: {module} }}" if module else ""
  return f"events {{ metadata_id: {meta} offset_ps: {int(start_us * 1e6)} duration_ps: {int(dur_us * 1e6)}{stat} }}"


def _plane(pid, name, lines):
  body = "".join(
    f'lines {{ id: {i} name: "{lname}" timestamp_ns: 0 {" ".join(evs)} }}' for i, (lname, evs) in enumerate(lines, 1)
  )
  meta = "".join(f'event_metadata {{ key: {k} value {{ id: {k} name: "{v}" }} }}' for k, v in NAMES.items())
  stats = 'stat_metadata { key: 100 value { id: 100 name: "hlo_module" } }' + "".join(
    f'stat_metadata {{ key: {k} value {{ id: {k} name: "{v}" }} }}' for k, v in MODULES.items()
  )
  return f'planes {{ id: {pid} name: "{name}" {body} {meta} {stats} }}'


def synthetic_trace() -> ProfileData:
  """Three calls on GPU 0's stream between separators (the second one a
  flush), plus what must not count: an event before the first separator,
  one after the last, one without an `hlo_module`, a derived `XLA Ops` line
  repeating the kernels, and GPU 1's work at the same time."""
  stream = [
    _event(3, 0, 50, 10),  # before the first separator
    _event(4, 100, 3, 11),  # separator
    _event(1, 110, 5, 10),
    _event(3, 116, 2, 10),  # call 1: kernel 5, device 7
    _event(4, 120, 40, 12),  # flush (excluded however long)
    _event(2, 170, 7, 10),
    _event(3, 178, 1, 10),
    _event(1, 180, 2),  # call 2: kernel 7, device 8; no module
    _event(4, 190, 3, 11),
    _event(1, 200, 4, 10),
    _event(1, 205, 4, 10),
    _event(3, 210, 2, 10),  # call 3: kernel 8, device 10
    _event(4, 220, 3, 11),
    _event(3, 230, 9, 10),  # after the last separator
  ]
  derived = [_event(1, 110, 5, 10), _event(2, 170, 7, 10)]
  other_gpu = [_event(4, 95, 1, 11), _event(1, 150, 500, 10), _event(4, 700, 1, 11)]
  text = _plane(1, "/device:GPU:0", [("Stream #7(Kernel)", stream), ("XLA Ops", derived)]) + _plane(
    2, "/device:GPU:1", [("Stream #7(Kernel)", other_gpu)]
  )
  return ProfileData.from_text_proto(text)


def test_gpu_events_are_selected_and_split_per_call():
  events = pe.xla_events(synthetic_trace(), pe.gpu_where(0))
  assert [e.start_ns for e in events] == sorted(e.start_ns for e in events)
  assert len(events) == 13  # the stream's events with a module; not the derived line, not GPU 1
  calls = pe.split_calls(events)
  assert [[e.name for e in c] for c in calls] == [
    ["dense_gemm_nt", "loop_convert_fusion"],
    ["dense_gemm_nt_1", "loop_convert_fusion"],
    ["dense_gemm_nt", "dense_gemm_nt", "loop_convert_fusion"],
  ]
  times = pe.call_times(calls, pe.name_matcher(["dense_gemm_nt"]))
  assert [(t.device_ns, t.kernel_ns) for t in times] == [(7000, 5000), (8000, 7000), (10000, 8000)]
  assert pe.spread_ms([t.device_ns for t in times]) == {"median_ms": 0.008, "min_ms": 0.007, "max_ms": 0.01}
  assert pe.spread_ms([t.kernel_ns for t in times]) == {"median_ms": 0.007, "min_ms": 0.005, "max_ms": 0.008}


def test_gpu_plane_choice():
  trace = synthetic_trace()
  assert len(pe.split_calls(pe.xla_events(trace, pe.gpu_where(1)))) == 1  # GPU 1: its own call
  with pytest.raises(ValueError, match="no plane '/device:GPU:5'.*GPU:0"):
    pe.xla_events(trace, pe.gpu_where(5))  # two GPU planes: no guessing
  only = ProfileData.from_text_proto(_plane(3, "/device:GPU:3", [("Stream #1", [_event(4, 0, 1, 11)])]))
  assert len(pe.xla_events(only, pe.gpu_where(0))) == 1  # the only GPU plane stands in


def test_name_matcher():
  match = pe.name_matcher(["qsa_sparse_gqa_split", "qsa_sparse_gqa_combine", ""])
  assert match("qsa_sparse_gqa_split") and match("qsa_sparse_gqa_combine_2")
  assert not match("loop_fusion") and not match("qsa_sparse") and not pe.name_matcher([])("x")


def _op():
  f = jax.jit(lambda x: jnp.sin(x) @ x.T + 1.0)
  x = jnp.linspace(0.0, 1.0, 96 * 96, dtype=jnp.float32).reshape(96, 96)
  jax.block_until_ready(f(x))
  return lambda: f(x)


def traced_calls(fn, n):
  """A real trace of `n` calls of `fn` between separators: (events, calls)."""
  sep = bench._separator(jax.devices()[0], False)
  events = pe.xla_events(bench.capture(lambda: bench.between_separators(fn, n, sep)), pe.Where(pe.CPU_PLANE))
  return events, pe.split_calls(events)


def test_real_cpu_trace_holds_each_call_between_separators():
  events, calls = traced_calls(_op(), 3)
  assert sum(pe.is_separator(e) for e in events) == 4
  assert len(calls) == 3 and all(len(c) == len(calls[0]) > 0 for c in calls)
  assert {e.module for c in calls for e in c} == {"jit__lambda"}


IN_MEMORY = pytest.mark.skipif(
  not hasattr(jax.profiler, "ProfileSession"),
  reason=f"jax {jax.__version__} has no jax.profiler.ProfileSession (jax >= 0.12)",
)


@pytest.mark.parametrize("in_memory,cold_l2", [pytest.param(True, False, marks=IN_MEMORY), (False, True)])
def test_profile_calls_on_a_real_cpu_trace(in_memory, cold_l2):
  """Both ways of reading a trace (jax 0.12 in memory, jax 0.11 through the
  .xplane.pb file) and both separators give one time per call."""
  fn = _op()
  first = traced_calls(fn, 1)[1][0][0].name  # "kernels": the call's first XLA op
  t = bench.profile_calls(
    fn, 4, cold_l2=cold_l2, kernel_names=[first], where=pe.Where(pe.CPU_PLANE), in_memory=in_memory
  )
  assert t["timer"] == bench.TIMER_DEVICE and t["samples"] == 4
  assert 0 < t["min_ms"] <= t["median_ms"] <= t["max_ms"]
  assert 0 < t["kernel_median_ms"] <= t["median_ms"] and t["kernel_max_ms"] <= t["max_ms"]
  assert ("L2 flushed" in t["method"]) == cold_l2


def test_profile_calls_without_the_kernels_events_says_so():
  t = bench.profile_calls(_op(), 2, cold_l2=False, kernel_names=["no_such_kernel"], where=pe.Where(pe.CPU_PLANE))
  assert t["kernel_median_ms"] is None and "no_such_kernel" in t["note"] and t["median_ms"] > 0


def test_measure_names_its_timer():
  calls = []
  fn = _op()
  counted = lambda: calls.append(1) or fn()  # noqa: E731
  t = bench.measure(counted, warmup=2, iters=4, on_gpu=False, interpret=True)
  assert t["timer"] == bench.TIMER_INTERPRET and t["samples"] == 4 and len(calls) == 6
  assert t["min_ms"] <= t["median_ms"] <= t["max_ms"]
  assert bench.measure(fn, warmup=0, iters=2, on_gpu=False)["timer"] == bench.TIMER_WALL
  # No GPU plane in this trace: the wall clock (calls in flight), labelled, with the reason.
  t = bench.measure(fn, warmup=0, iters=3, on_gpu=True)
  assert t["timer"] == bench.TIMER_WALL and "in flight" in t["method"]
  assert "device timer unavailable" in t["note"] and "/device:GPU:0" in t["note"]
  t = bench.measure(fn, warmup=0, iters=2, on_gpu=True, cold_l2=True)
  assert t["calls_per_sample"] == 1 and "L2 flush" in t["method"]
  t = bench.measure(fn, warmup=1, iters=3, on_gpu=False, where=pe.Where(pe.CPU_PLANE))
  assert t["timer"] == bench.TIMER_DEVICE and t["samples"] == 3 and "note" not in t


def test_pallas_call_names_of_a_lowered_kernel():
  from jaxkern import registry, selection
  from pallas_kernels.shared.lowering import lower_for_h100

  op = registry.get("qsa_sparse_gqa_decode_qwen38_h24_kv2_d256_topk512_c4")
  shapes = op.input_shapes(op.validated_axes(selection.largest_recorded_axes(op.definition)))
  text = lower_for_h100(lambda x: op.kernel(x, interpret=False), shapes)
  assert bench.pallas_call_names(text) == ("qsa_sparse_gqa_split",)
  assert bench.pallas_call_names("module @jit_f {}") == ()


def test_compile_cache_keeps_kernel_names_only_when_asked():
  inputs = {"x": jnp.ones((4,), jnp.float32)}
  for record in (False, True):
    cache = bench.CompileCache(kernel_names=record)
    exe = cache.get("k", lambda: lambda d: d["x"] * 2, inputs)
    assert exe is cache.get("k", lambda: None, inputs)  # compiled once per shapes
    assert cache.kernel_names("k", inputs) == ()  # no Pallas call in this one


def test_a_profiler_that_fails_falls_back_to_the_wall_clock(monkeypatch):
  """Whatever goes wrong in the trace (here: the profiler API itself), the
  workload is still timed, by the wall clock, and says why."""

  def broken(*args, **kwargs):
    raise TypeError("ProfileSession() takes no arguments")

  monkeypatch.setattr(bench, "capture", broken)
  t = bench.measure(_op(), warmup=0, iters=2, on_gpu=True)
  assert t["timer"] == bench.TIMER_WALL and "TypeError: ProfileSession() takes no arguments" in t["note"]
