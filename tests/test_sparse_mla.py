"""Sparse MLA prefill (SPEC 4.9): the kit's data (launches; edge cases for
the kernel in interpret mode: lonely rows, indices >= Nkv, fewer valid slots
than TOPK, M = 1, ragged slot blocks, the output-column split, records at
CPU scale) and the family's own checks: the traced scale, the reference
against float64 numpy, workspace/index synthesis against the recorded
structure, the heuristic. (The checks themselves: test_definitions.py and
kit.py.)"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kit import EVERY_CANDIDATE, Case, MosaicGpuCall, TritonCall
from numerics import assert_bf16_close, assert_f32_close

from jaxkern.families import sparse_mla as fam
from pallas_kernels.sparse_mla import mosaic_gpu as sm_mosaic
from pallas_kernels.sparse_mla import triton as sm

REPO = pathlib.Path(__file__).resolve().parent.parent
K128 = "sparse_mla_prefill_h64_d512_k128"
K640 = "sparse_mla_prefill_h64_d512_k640"
TOPK = {K128: 128, K640: 640}
CONST = dict(H=64, HKV=1, D=512)

# Small tilings for interpret mode: several slot blocks and head groups,
# D in chunks, TOPK split over programs (ragged runs), with and without the
# index carry.
SMALL = sm.SparseMlaPrefillConfig(block_h=32, block_k=32, block_d=512, prefetch=True, num_warps=4)
CHUNKED = sm.SparseMlaPrefillConfig(block_h=16, block_k=16, block_d=128, prefetch=True, num_warps=4)
SPLIT = sm.SparseMlaPrefillConfig(block_h=16, block_k=16, block_d=128, splits=3, prefetch=False, num_warps=4)
MOSAIC_UNSPLIT = sm_mosaic.MosaicSparseMlaConfig()
# Both consumers scoring every slot (the heuristic's consumers each score half).
MOSAIC_FULL_SCORES = sm_mosaic.MosaicSparseMlaConfig(half_slots=False)


def records(name):
  path = REPO / "datasets" / "workloads" / f"{name}.jsonl"
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def full_axes(name, axes):
  return dict(axes, TOPK=TOPK[name], **CONST)


def assert_close(out, lse, ref_out, ref_lse):
  """SPEC 5: bf16 out, f32 lse; +inf lse must match +inf exactly."""
  assert lse.dtype == jnp.float32
  assert_bf16_close(out, ref_out)
  assert_f32_close(lse, ref_lse)


def random_problem(m, nkv, topk, *, heads=64, dim=512, seed=0, lo=-3, hi_extra=5):
  """N(0,1) q/kv, random indices in [lo, Nkv + hi_extra): some negative, some
  past the end, duplicates allowed."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((m, heads, dim), np.float32), jnp.bfloat16)
  kv = jnp.asarray(rng.standard_normal((nkv, 1, dim), np.float32), jnp.bfloat16)
  idx = rng.integers(lo, nkv + hi_extra, (m, 1, topk)).astype(np.int32)
  sink = jnp.asarray(rng.uniform(-2, 4, heads), jnp.float32)
  return q, kv, idx, jnp.float32(dim**-0.5), sink


def numpy_float64(q, kv, indices, sm_scale, attn_sink):
  """Independent float64 computation, one row at a time (SPEC 4.9)."""
  q = np.asarray(q, np.float64)
  kv = np.asarray(kv, np.float64)[:, 0]
  sink = np.asarray(attn_sink, np.float64)
  m, heads, dim = q.shape
  out = np.zeros((m, heads, dim))
  lse = np.full((m, heads), np.inf)
  for i in range(m):
    rows = [j for j in np.asarray(indices)[i, 0] if 0 <= j < kv.shape[0]]
    if not rows:
      continue
    k = kv[rows]
    p = q[i] @ k.T * float(sm_scale)
    mx = p.max(axis=1, keepdims=True)
    e = np.exp(p - mx)
    lse[i] = mx[:, 0] + np.log(e.sum(axis=1))
    out[i] = (np.exp(p) @ k) / (np.exp(p).sum(axis=1) + np.exp(sink))[:, None]
  return out, lse


# ---------------------------------------------------------------------------
# Reference vs float64 numpy.


def test_reference_matches_float64():
  q, kv, idx, scale, sink = random_problem(37, 90, 48, heads=16, dim=64, seed=1)
  idx[3] = -1  # lonely
  idx[4] = 90 + np.arange(48)  # all >= Nkv: lonely
  idx[5, 0, 1:] = -1  # one valid slot
  out, lse = fam.sparse_mla_prefill_reference(q, kv, jnp.asarray(idx), scale, sink)
  ref_out, ref_lse = numpy_float64(q, kv, idx, scale, sink)
  np.testing.assert_allclose(np.asarray(out, np.float32), ref_out, atol=4e-3, rtol=8e-3)
  np.testing.assert_array_equal(np.isinf(np.asarray(lse)), np.isinf(ref_lse))
  fin = np.isfinite(ref_lse)
  assert_f32_close(np.asarray(lse)[fin], ref_lse[fin])
  assert np.all(np.asarray(out[3:5], np.float32) == 0) and np.all(np.isinf(np.asarray(lse[3:5])))


def test_reference_sink_only_in_denominator():
  """One valid slot: out = kv / (1 + exp(sink - P)), lse = P."""
  q, kv, idx, scale, sink = random_problem(2, 8, 4, heads=16, dim=32, seed=2)
  idx[:, 0, :] = -1
  idx[:, 0, 2] = 5
  out, lse = fam.sparse_mla_prefill_reference(q, kv, jnp.asarray(idx), scale, sink)
  p = np.einsum("mhd,d->mh", np.asarray(q, np.float64), np.asarray(kv[5, 0], np.float64)) * float(scale)
  np.testing.assert_allclose(np.asarray(lse), p, rtol=1e-5, atol=1e-5)
  weight = 1.0 / (1.0 + np.exp(np.asarray(sink, np.float64)[None] - p))
  expected = weight[..., None] * np.asarray(kv[5, 0], np.float64)[None, None]
  np.testing.assert_allclose(np.asarray(out, np.float32), expected, atol=4e-3, rtol=8e-3)


def test_reference_chunks_rows():
  """More rows than one reference chunk, M not a multiple of it."""
  q, kv, idx, scale, sink = random_problem(fam._REFERENCE_ROW_CHUNK * 2 + 3, 50, 16, heads=16, dim=32, seed=3)
  out, lse = fam.sparse_mla_prefill_reference(q, kv, jnp.asarray(idx), scale, sink)
  ref_out, ref_lse = numpy_float64(q, kv, idx, scale, sink)
  np.testing.assert_allclose(np.asarray(out, np.float32), ref_out, atol=4e-3, rtol=8e-3)
  fin = np.isfinite(ref_lse)
  assert_f32_close(np.asarray(lse)[fin], ref_lse[fin])


# ---------------------------------------------------------------------------
# Kit data: launches, edge cases (kernel in interpret mode vs reference).


def launches(config, axes):
  """Grid (head blocks, TOPK splits, query rows); with splits, then the
  shared combine (`split_kv`) over (head blocks, rows, D blocks)."""
  h, d, m, topk = axes["H"], axes["D"], axes["M"], axes["TOPK"]
  block_k = max(16, min(config.block_k, 1 << max(topk - 1, 0).bit_length()))
  blocks = -(-topk // block_k)
  splits = -(-blocks // -(-blocks // config.splits))  # runs of equal length, the last shorter
  calls = [
    TritonCall("sparse_mla_prefill", (h // min(config.block_h, h), splits, m), config.num_warps, config.num_stages)
  ]
  if splits > 1:
    c = config.combine
    calls.append(
      TritonCall(
        "sparse_mla_prefill_combine",
        (h // min(c.block_h, h & -h), m, d // min(c.block_d, d & -d)),
        c.num_warps,
        c.num_stages,
      )
    )
  return calls


def launches_mosaic_gpu(config, axes):
  """One Mosaic GPU call, grid (head blocks of 64, TOPK splits, query
  rows): q, the workspace as [Nkv, D], a zeros row, the indices padded with
  -1 to whole slot blocks as [M, blocks, block_k], the slot block table, the
  sinks and the per-head scales in; out and lse out, or with splits their
  fp32 partials (the Triton combine follows)."""
  h, d, m, nkv, topk = axes["H"], axes["D"], axes["M"], axes["Nkv"], axes["TOPK"]
  blocks = -(-topk // config.block_k)
  splits = -(-blocks // -(-blocks // config.splits))  # runs of equal length, the last shorter
  operands = (
    f"tensor<{m}x{h}x{d}xbf16>",
    f"tensor<{nkv}x{d}xbf16>",
    f"tensor<1x{d}xbf16>",
    f"tensor<{m}x{blocks}x{config.block_k}xi32>",
    f"tensor<{m}x2xi32>",
    f"tensor<{h}xf32>",
    f"tensor<{h}xf32>",
  )
  if splits == 1:
    return [MosaicGpuCall(operands, (f"tensor<{m}x{h}x{d}xbf16>", f"tensor<{m}x{h}xf32>"))]
  return [MosaicGpuCall(operands, (f"tensor<{m}x{splits}x{h}x{d}xf32>", f"tensor<{m}x{splits}x{h}xf32>"))]


def problem(m, nkv, topk, seed, **kw):
  """`random_problem` as the definition's named inputs."""

  def build():
    q, kv, idx, scale, sink = random_problem(m, nkv, topk, seed=seed, **kw)
    return {"q": q, "kv": kv, "indices": jnp.asarray(idx), "sm_scale": scale, "attn_sink": sink}

  return build


def edge_rows():
  """Lonely rows (all -1; all >= Nkv), one valid slot at the very end, valid
  slots only in the middle block, fewer valid than TOPK, duplicates."""
  m, nkv, topk = 8, 100, 96
  q, kv, idx, scale, sink = random_problem(m, nkv, topk, seed=5, lo=0, hi_extra=0)
  idx[0] = -1
  idx[1] = nkv + np.arange(topk)
  idx[2] = -1
  idx[2, 0, -1] = 7
  idx[3] = -1
  idx[3, 0, 40:50] = np.arange(10)
  idx[4, 0, 60:] = -1
  idx[5] = 3  # one row gathered 96 times
  idx[6, 0, ::2] = nkv  # every other slot invalid
  return {"q": q, "kv": kv, "indices": jnp.asarray(idx), "sm_scale": scale, "attn_sink": sink}


def first_two_rows_lonely(out, ref, inputs):
  assert np.all(np.asarray(out["out"][:2], np.float32) == 0) and np.all(np.isinf(np.asarray(out["lse"][:2])))
  assert np.all(np.isfinite(np.asarray(out["lse"][2:])))


def record_picks(name):
  """The two structurally distinct records of a definition: the largest
  workspace and an uncached one."""
  recs = records(name)
  return [max(recs, key=lambda r: r["axes"]["Nkv"]), next(r for r in recs if r["variant"].endswith("cached_False"))]


KERNEL_CASES = [
  *(
    Case(K128, inputs=problem(m, nkv, topk, seed=m + topk), config=config, id=label)
    for m, nkv, topk, config, label in [
      (6, 300, 80, SMALL, "ragged_last_slot_block"),  # 80 = 2.5 x 32
      (1, 40, 128, SMALL, "one_row"),
      (3, 200, 640, None, "k640_heuristic_split"),  # 32 heads, 4 TOPK splits
      (4, 64, 24, CHUNKED, "topk_below_32_d_chunks"),
      (5, 300, 80, SPLIT, "split_ragged_runs"),  # 5 blocks of 16 in runs 2, 2, 1
      (2, 90, 40, dataclasses.replace(CHUNKED, prefetch=False), "no_index_carry"),
    ]
  ),
  *(
    Case(K128, inputs=edge_rows, config=c, check=first_two_rows_lonely, id=f"edge_rows_{i}")
    for i, c in enumerate((SMALL, CHUNKED, SPLIT))
  ),
  *(
    Case(name, fam.cpu_axes(full_axes(name, rec["axes"])), record=rec, id=f"record_{rec['uuid'][:8]}")
    for name in (K128, K640)
    for rec in record_picks(name)
  ),
  # The Mosaic GPU kernel (its own checks: test_sparse_mla_mosaic.py);
  # at these M its heuristic splits TOPK (M = 3: 4 splits, the last of 10
  # blocks alone; M = 6 and 1: 2), so each case also runs unsplit.
  *(
    Case(
      K128, inputs=problem(m, nkv, topk, seed=m + topk), config=config, id=f"mosaic_{label}_{tag}", backend="mosaic_gpu"
    )
    for m, nkv, topk, label in [
      (6, 300, 80, "ragged_last_slot_block"),
      (1, 40, 128, "one_row"),
      (3, 200, 640, "k640"),
      (4, 64, 24, "topk_below_one_block"),
    ]
    for config, tag in [(None, "heuristic"), (MOSAIC_UNSPLIT, "unsplit")]
  ),
  *(
    Case(
      K128,
      inputs=edge_rows,
      config=config,
      check=first_two_rows_lonely,
      id=f"mosaic_edge_rows_{tag}",
      backend="mosaic_gpu",
    )
    for config, tag in [(None, "heuristic"), (MOSAIC_UNSPLIT, "unsplit"), (MOSAIC_FULL_SCORES, "full_scores")]
  ),
  # Records at CPU scale: k128's two (a k640 record takes 20-45 s in the
  # Mosaic GPU interpreter; the replay with --config.backend=mosaic_gpu
  # runs all 30, docs/perf/mosaic_gpu.md).
  *(
    Case(
      K128,
      fam.cpu_axes(full_axes(K128, rec["axes"])),
      record=rec,
      id=f"mosaic_record_{rec['uuid'][:8]}",
      backend="mosaic_gpu",
    )
    for rec in record_picks(K128)
  ),
]
# Each distinct tiling of the candidates (warps and stages do not change
# interpret-mode semantics).
SWEEP_CASE = Case(K640, inputs=problem(1, 120, 640, seed=9), id="m1_k640")
SWEEP_CASE_MOSAIC_GPU = Case(K640, inputs=problem(2, 120, 640, seed=9), id="m2_k640")
# The smallest recorded M: the heuristic splits TOPK; every candidate too.
LOWERING_CASES = [
  Case(K640, dict(M=128, Nkv=256), config=EVERY_CANDIDATE),
  Case(K128, dict(M=128, Nkv=128), config=EVERY_CANDIDATE),
  # Below a wave of CTAs the Mosaic GPU kernel splits TOPK.
  Case(K640, dict(M=16, Nkv=256), config=EVERY_CANDIDATE, backend="mosaic_gpu"),
  Case(K128, dict(M=40, Nkv=128), config=EVERY_CANDIDATE, backend="mosaic_gpu"),
]


# ---------------------------------------------------------------------------
# The kernel's own checks.


def test_kernel_traced_scale_and_large_sink():
  """sm_scale traced under jit; a sink that dominates the denominator."""
  q, kv, idx, _, sink = random_problem(2, 50, 32, seed=6, lo=0, hi_extra=0)
  sink = sink.at[:8].set(30.0).at[8:16].set(-30.0)
  f = jax.jit(lambda s: sm.sparse_mla_prefill(q, kv, jnp.asarray(idx), s, sink, config=SMALL, interpret=True))
  out, lse = f(jnp.float32(0.07))
  assert_close(out, lse, *fam.sparse_mla_prefill_reference(q, kv, jnp.asarray(idx), 0.07, sink))


def test_slot_block_limits():
  idx = jnp.asarray([[-1, -1, 5, -1, -1, -1, 9, -1], [-1] * 8, [1] * 8, [20] + [-1] * 7])
  lim = np.asarray(sm.slot_block_limits(idx, 10, 2))
  np.testing.assert_array_equal(lim, [[1, 4], [0, 0], [0, 4], [0, 0]])


# ---------------------------------------------------------------------------
# Synthesis.


@pytest.mark.parametrize("name", [K128, K640])
def test_layout_reproduces_every_record(name):
  """Nkv = window rows + compressed rows exactly (no spare) for every record,
  from its scheduler_sequence_lengths and compression_ratio."""
  for rec in records(name):
    a = rec["axes"]
    layout = fam.workspace_layout(a["M"], a["Nkv"], TOPK[name], rec)
    assert layout.spare == 0 and layout.num_rows == a["Nkv"], (a, layout)
    assert sum(layout.new) == a["M"]
    assert layout.ratio == rec["compression_ratio"]
    assert list(layout.seq_lens) == rec["scheduler_sequence_lengths"]


def check_indices(layout, idx, topk, nkv):
  idx = np.asarray(idx)[:, 0]
  assert idx.shape == (sum(layout.new), topk) and idx.dtype == np.int32
  assert np.all((idx == -1) | ((idx >= 0) & (idx < nkv - layout.spare)))
  slots = min(128, topk)
  window = idx[:, :slots]
  comp = idx[:, slots:]
  row = 0
  for i, (new, cached) in enumerate(zip(layout.new, layout.cached)):
    for j in range(new):
      p = cached + j
      w = window[row]
      n = min(slots, p + 1)
      assert np.all(w[n:] == -1) and np.all(np.diff(w[:n]) == 1)
      # The last window slot is the query token itself.
      assert w[n - 1] == sum(layout.new[:i]) + sum(layout.window_cached[:i]) + layout.window_cached[i] + j
      if comp.shape[1]:
        c = comp[row]
        visible = (p + 1) // layout.ratio if layout.ratio else 0
        count = min(visible, topk - slots)
        assert np.all(c[count:] == -1) and np.all(np.diff(c[:count]) > 0)
        base = layout.window_rows + sum(layout.compressed[:i])
        assert np.all((c[:count] >= base) & (c[:count] < base + visible))
      row += 1


@pytest.mark.parametrize("name", [K128, K640])
def test_synthesized_indices_structure_at_cpu_scale(name):
  for rec in records(name):
    axes = fam.cpu_axes(full_axes(name, rec["axes"]))
    layout = fam.workspace_layout(axes["M"], axes["Nkv"], TOPK[name], rec)
    assert layout.num_rows == axes["Nkv"]
    idx = fam.layout_indices(layout, TOPK[name], np.random.default_rng(0))
    check_indices(layout, idx, TOPK[name], axes["Nkv"])


def test_synthesized_indices_structure_full_size():
  """The largest recorded workspace: 512 of ~1M compressed rows selected."""
  rec = max(records(K640), key=lambda r: r["axes"]["Nkv"])
  a = rec["axes"]
  layout = fam.workspace_layout(a["M"], a["Nkv"], 640, rec)
  idx = fam.layout_indices(layout, 640, np.random.default_rng(0))
  check_indices(layout, idx, 640, a["Nkv"])
  assert np.all(np.asarray(idx)[:, 0, 128:] >= 0)  # every query sees >= 512


@pytest.mark.parametrize(
  "m,nkv,topk", [(1, 1, 128), (1, 1, 640), (5, 5, 640), (7, 300, 640), (3, 1000, 128), (64, 70, 640), (2, 2000, 16)]
)
def test_synthesis_from_axes_alone(m, nkv, topk):
  layout = fam.workspace_layout(m, nkv, topk, None)
  assert layout.num_rows == nkv and sum(layout.new) == m
  idx = fam.layout_indices(layout, topk, np.random.default_rng(1))
  check_indices(layout, idx, topk, nkv)


def test_make_inputs_deterministic_and_typed():
  rec = records(K640)[0]
  axes = full_axes(K640, rec["axes"])
  a = fam.make_inputs(axes, jax.random.key(3), rec)
  b = fam.make_inputs(axes, jax.random.key(3), rec)
  c = fam.make_inputs(axes, jax.random.key(4), rec)
  spec = json.loads((REPO / "datasets" / "definitions" / f"{K640}.json").read_text())
  assert list(a) == list(spec["inputs"])
  for name, t in spec["inputs"].items():
    shape = tuple(axes[d] for d in t["shape"]) if t["shape"] else ()
    assert a[name].shape == shape and str(a[name].dtype) == t["dtype"], name
    np.testing.assert_array_equal(np.asarray(a[name], np.float32), np.asarray(b[name], np.float32))
  assert not np.array_equal(np.asarray(a["q"], np.float32), np.asarray(c["q"], np.float32))
  assert float(a["sm_scale"]) == pytest.approx(512**-0.5)


@pytest.mark.parametrize("name", [K128, K640])
def test_cpu_axes(name):
  for rec in records(name):
    axes = full_axes(name, rec["axes"])
    small = fam.cpu_axes(axes)
    assert small["M"] == min(axes["M"], 16) and small["Nkv"] >= small["M"]
    assert {k: small[k] for k in CONST} == CONST and small["TOPK"] == TOPK[name]
    if axes["Nkv"] - axes["M"] <= 256:
      assert small["Nkv"] - small["M"] == axes["Nkv"] - axes["M"]  # cached window kept


# ---------------------------------------------------------------------------
# Configs, the public op, arguments.


def largest_shapes(name):
  recs = records(name)
  m = max(r["axes"]["M"] for r in recs)
  nkv = max(r["axes"]["Nkv"] for r in recs)
  return {
    "q": jax.ShapeDtypeStruct((m, 64, 512), jnp.bfloat16),
    "kv": jax.ShapeDtypeStruct((nkv, 1, 512), jnp.bfloat16),
    "indices": jax.ShapeDtypeStruct((m, 1, TOPK[name]), jnp.int32),
    "sm_scale": jax.ShapeDtypeStruct((), jnp.float32),
    "attn_sink": jax.ShapeDtypeStruct((64,), jnp.float32),
  }


def shapes_at(name, m):
  shapes = largest_shapes(name)
  shapes["q"] = jax.ShapeDtypeStruct((m, 64, 512), jnp.bfloat16)
  shapes["indices"] = jax.ShapeDtypeStruct((m, 1, TOPK[name]), jnp.int32)
  return shapes


@pytest.mark.parametrize(
  "name,m,block_k,splits",
  [
    (K640, 4096, 64, 1),
    (K128, 4096, 64, 1),
    (K640, 448, 64, 1),
    (K640, 128, 64, 2),
    (K128, 128, 64, 2),
    (K640, 1, 64, 4),
    (K128, 1, 32, 4),
  ],
)
def test_heuristic_grids(name, m, block_k, splits):
  """32-head tiles with 128-column D chunks everywhere; TOPK split only
  under two waves of 132 SMs, into enough runs for two waves at the
  smallest recorded M = 128 (at most MAX_SPLITS)."""
  config = sm.choose_config(shapes_at(name, m))
  assert (config.block_h, config.block_d, config.block_k, config.splits) == (32, 128, block_k, splits)
  ((call, *combine),) = [launches(config, full_axes(name, dict(M=m, Nkv=m)))]
  assert call.grid == (2, splits, m)
  assert len(combine) == (splits > 1)
  if m == 128:
    assert 2 * m * splits >= 2 * 132
  assert splits <= sm.MAX_SPLITS


def test_config_rules():
  with pytest.raises(ValueError, match="block_k=48 must be a power of two"):
    sm.SparseMlaPrefillConfig(block_k=48)
  with pytest.raises(ValueError, match="splits=0 must be an int >= 1"):
    sm.SparseMlaPrefillConfig(splits=0)
  shapes = shapes_at(K640, 1)
  shapes["indices"] = jax.ShapeDtypeStruct((1, 1, 20), jnp.int32)
  fitted = sm._fit(sm.SparseMlaPrefillConfig(splits=4), sm.SparseMlaSizes.of(shapes))
  assert (fitted.block_k, fitted.splits) == (32, 1)  # one 32-slot block: one run


def test_ops_function_both_backends_under_jit():
  from jaxkern import ops

  q, kv, idx, _, sink = random_problem(3, 40, 64, seed=11)
  ref = fam.sparse_mla_prefill_reference(q, kv, jnp.asarray(idx), 512**-0.5, sink)
  for backend in ("xla", "pallas"):
    f = jax.jit(lambda q, kv, i, s, b=backend: ops.sparse_mla_prefill(q, kv, i, s, backend=b))
    out, lse = f(q, kv[:, 0], jnp.asarray(idx[:, 0]), sink)  # [Nkv, D] / [M, TOPK] forms
    assert_close(out, lse, *ref)


def test_bad_arguments_raise():
  q, kv, idx, scale, sink = random_problem(2, 10, 16, seed=0)
  with pytest.raises(ValueError):
    sm.sparse_mla_prefill(q, kv[:, 0], jnp.asarray(idx), scale, sink, interpret=True)
  with pytest.raises(ValueError):
    sm.sparse_mla_prefill(q, kv, jnp.asarray(idx[:, 0]), scale, sink, interpret=True)
  with pytest.raises(ValueError):
    sm.sparse_mla_prefill(q, kv.astype(jnp.float32), jnp.asarray(idx), scale, sink, interpret=True)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_empty_batch_and_lonely_batch(backend):
  """M = 0 gives empty outputs on both paths; rows whose slots are all
  invalid (negative, >= Nkv) give 0 and +inf."""
  from jaxkern import ops

  q, kv, idx, _, sink = random_problem(2, 10, 32, heads=64, seed=12)
  out, lse = ops.sparse_mla_prefill(q[:0], kv, jnp.asarray(idx[:0]), sink, backend=backend)
  assert out.shape == (0, 64, 512) and out.dtype == jnp.bfloat16 and lse.shape == (0, 64)
  bad = np.where(np.arange(32) % 2 == 0, -5, 10).astype(np.int32)[None, None].repeat(2, 0)
  out, lse = ops.sparse_mla_prefill(q, kv, jnp.asarray(bad), sink, backend=backend)
  assert np.all(np.asarray(out, np.float32) == 0) and np.all(np.isposinf(np.asarray(lse)))
