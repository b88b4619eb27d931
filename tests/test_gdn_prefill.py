"""Gated delta net chunked prefill (SPEC 4.8): the kit's data (launches of
both forms; edge cases for the kernel in interpret mode: chunk boundaries,
empty sequences, 24 short sequences, other blockings and chunk sizes,
correlated keys; lowering of the heuristic's launches at T=6, 5709 and 8192)
and the family's own checks: the reference against the float64 NumPy
recurrence of test_gdn_decode.py, independence of packed sequences, the
one-token case against decode, the chunk-parallel grid size, the buffers
the chunked launches move, input synthesis and CPU axes.
(The checks themselves: test_definitions.py and kit.py.)"""

from __future__ import annotations

import dataclasses
import math

import gradients
import jax
import jax.numpy as jnp
import kit
import numpy as np
import pytest
from kit import Case, TritonCall
from numerics import assert_bf16_close, assert_f32_close
from test_gdn_decode import CONST, WHOLE_HEAD, check_against_definition, numpy_gdn, recorded_axes

from jaxkern import ops, registry
from jaxkern.families import gdn_prefill as fam_prefill
from pallas_kernels.gdn_decode import triton as gk_decode
from pallas_kernels.gdn_prefill import config as gp_config
from pallas_kernels.gdn_prefill import triton as gk_prefill
from pallas_kernels.gdn_prefill import triton_bwd as gk_bwd
from pallas_kernels.shared.lowering import lower_for_h100, triton_buffers, triton_calls

PREFILL = "gdn_prefill_qk4_v8_d128_k_last"


def prefill_inputs(lengths, seed=0, scale=0.0):
  """Synthesized inputs with the given sequence lengths."""
  total, n = int(sum(lengths)), len(lengths)
  x = fam_prefill.make_prefill_inputs(
    dict(total_seq_len=total, num_seqs=n, len_cu_seqlens=n + 1, **CONST), jax.random.key(seed)
  )
  x["cu_seqlens"] = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
  x["scale"] = jnp.float32(scale)
  return x


def state_errors(actual, desired):
  """(relative RMS, relative max, worst per-(sequence, head) relative RMS):
  the gdn_prefill_state metric of SPEC 5. All-zero reference rows (empty
  sequences) must be matched exactly and are left out of the per-head term."""
  x, y = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
  assert x.shape == y.shape and np.all(np.isfinite(x))
  e = x - y
  rel_rms = np.sqrt((e**2).mean() / (y**2).mean())
  rel_max = np.abs(e).max() / np.abs(y).max()
  head_ref = (y**2).mean(axis=(2, 3))
  assert np.all(e[head_ref == 0] == 0)
  head = np.sqrt((e**2).mean(axis=(2, 3))[head_ref > 0] / head_ref[head_ref > 0])
  return rel_rms, rel_max, head.max(initial=0.0)


def launches(config, axes):
  """Form "chunked": intra and output grids over the chunk slots (T // chunk
  + N + 2: every sequence's chunks and two gap segments), the state pass over
  (sequences, HV, V blocks); form "serial": (sequences, HV, V blocks)."""
  t, n, hv, d = (axes[a] for a in ("total_seq_len", "num_seqs", "num_v_heads", "head_size"))
  if t == 0 or n == 0:
    return []
  if config.form == "serial":
    s = config.serial
    return [TritonCall("gdn_prefill_serial", (n, hv, d // min(s.block_v, d)), s.num_warps, s.num_stages)]
  slots = t // config.chunk + n + 2
  intra, state, output = config.intra, config.state, config.output
  return [
    TritonCall("gdn_prefill_intra", (slots, hv, 1), intra.num_warps, intra.num_stages),
    TritonCall("gdn_prefill_state", (n, hv, d // min(state.block_v, d)), state.num_warps, state.num_stages),
    TritonCall("gdn_prefill_output", (slots, hv, d // min(output.block_v, d)), output.num_warps, output.num_stages),
  ]


# One V block per head: fewest programs in interpret mode (each copies the
# state buffer); other blockings are cases of their own.
SMALL_PREFILL = gk_prefill.GdnPrefillConfig(
  state=gk_prefill.StateStage(block_v=128), output=gk_prefill.OutputStage(block_v=128)
)
SMALL_SERIAL = gk_prefill.GdnPrefillConfig(form="serial", chunk=32, serial=gk_prefill.SerialStage(block_v=128))


def close_to_the_recurrence(lengths):
  """bf16x3 dots keep the chunked state within f32 rounding noise of the
  recurrence; outputs are O(1); empty sequences get zero states."""

  def check(out, ref, inputs):
    assert np.abs(np.asarray(ref["output"], np.float32)).max() > 0.5
    state_within_rounding_noise(out, ref, inputs)
    for n, length in enumerate(lengths):
      if not length:
        assert np.all(np.asarray(out["new_state"][n]) == 0)

  return check


def correlated_keys():
  """Near-duplicate keys, beta ~ 1, no decay: the hardest case for the WY
  solve and for the split dots (single-bf16 dots fail the output tolerance
  here)."""
  x = prefill_inputs((200,), seed=12, scale=1.0)
  base = jax.random.normal(jax.random.key(1), (1, 4, 128))
  keys = base + 0.15 * jax.random.normal(jax.random.key(2), (200, 4, 128))
  x["k"] = x["q"] = (keys / jnp.linalg.norm(keys, axis=-1, keepdims=True)).astype(jnp.bfloat16)
  x["b"] = jnp.full((200, 8), 4.0, jnp.bfloat16)
  x["a"] = jnp.full((200, 8), -8.0, jnp.bfloat16)
  return x


def state_within_rounding_noise(out, ref, inputs):
  assert state_errors(out["new_state"], ref["new_state"])[0] < 1e-4


def _many_lengths():
  lengths = np.random.default_rng(0).integers(0, 4, 24)
  lengths[5] = 0
  return lengths


# Chunk boundaries (1, 63, 64, 65 tokens), an empty first and an empty
# inner sequence, three chunks with a ragged last one.
BOUNDARY_LENGTHS = (0, 1, 63, 64, 0, 65, 130)

KERNEL_CASES = [
  *(
    Case(
      PREFILL,
      inputs=lambda: prefill_inputs(BOUNDARY_LENGTHS, seed=7, scale=1.0),
      config=config,
      check=close_to_the_recurrence(BOUNDARY_LENGTHS),
      id=f"chunk_boundaries_{config.form}",
    )
    for config in (SMALL_PREFILL, SMALL_SERIAL)
  ),
  Case(
    PREFILL, inputs=lambda: prefill_inputs(_many_lengths(), seed=24), config=SMALL_PREFILL, id="many_short_sequences"
  ),
  *(
    Case(
      PREFILL,
      inputs=lambda: prefill_inputs((70, 1, 33), seed=8, scale=1.0),
      config=config,
      id=f"{config.form}_chunk{config.chunk}_{config.dot_precision}_blocks{config.state.block_v}"
      f"_{config.output.block_v}_{config.intra.block_d}_{config.intra.solve_block}",
    )
    for config in (
      gk_prefill.GdnPrefillConfig(
        chunk=32, intra=gp_config.IntraStage(solve_block=32), output=gk_prefill.OutputStage(block_v=32)
      ),
      gk_prefill.GdnPrefillConfig(
        chunk=16, intra=gp_config.IntraStage(block_d=128), state=gk_prefill.StateStage(block_v=16)
      ),
      gk_prefill.GdnPrefillConfig(dot_precision="bf16", intra=gp_config.IntraStage(solve_block=64)),
    )
  ),
  *(
    Case(
      PREFILL,
      inputs=correlated_keys,
      config=config,
      check=state_within_rounding_noise,
      id=f"correlated_keys_{config.form}",
    )
    for config in (SMALL_PREFILL, SMALL_SERIAL)
  ),
]
# Every candidate on two short sequences (one with a partial second chunk).
SWEEP_CASE = Case(PREFILL, {"total_seq_len": 90, "num_seqs": 2, "len_cu_seqlens": 3})
# The heuristic's launches where the issue asks for them: one short prefill
# (the serial form), two long sequences, 57 sequences (the largest record).
LOWERING_CASES = [
  Case(PREFILL, {"total_seq_len": t, "num_seqs": n, "len_cu_seqlens": n + 1}, id=f"t{t}_n{n}")
  for t, n in ((8192, 1), (6, 1), (5709, 2), (8192, 57))
]


@pytest.mark.parametrize("lengths,scale", [((3, 0, 5, 1), 0.0), ((0, 7), 0.7)])
def test_prefill_reference_matches_float64(lengths, scale):
  x = prefill_inputs(lengths, seed=5, scale=scale)
  out, new_state = fam_prefill.gdn_prefill_reference(**x)
  want_out, want_state = numpy_gdn(x, lengths)
  assert_bf16_close(out, want_out)
  np.testing.assert_allclose(np.asarray(new_state), want_state, rtol=1e-5, atol=1e-5)
  for n, length in enumerate(lengths):
    if not length:  # The definition's rule: an empty sequence's row is zero.
      assert np.all(np.asarray(new_state[n]) == 0)


# ------------------------------------------------------------------ prefill


def test_prefill_sequences_are_independent():
  """A packed sequence sees neither its neighbours' tokens nor their states,
  wherever it starts: sequence B after A (50 tokens) and before other
  tokens A' gives bit-identical outputs and state (same shapes: one compile)."""
  x = prefill_inputs((50, 70), seed=3, scale=1.0)
  y = {**prefill_inputs((70, 50), seed=4, scale=1.0), "A_log": x["A_log"], "dt_bias": x["dt_bias"]}
  for n in ("q", "k", "v", "a", "b"):
    y[n] = y[n].at[:70].set(x[n][50:])
  y["state"] = y["state"].at[0].set(x["state"][1])
  out, new_state = gk_prefill.gdn_prefill(**x, config=SMALL_PREFILL, interpret=True)
  out2, state2 = gk_prefill.gdn_prefill(**y, config=SMALL_PREFILL, interpret=True)
  np.testing.assert_array_equal(np.asarray(out[50:], np.float32), np.asarray(out2[:70], np.float32))
  np.testing.assert_array_equal(np.asarray(new_state[1]), np.asarray(state2[0]))


def test_prefill_single_token_matches_decode():
  x = prefill_inputs((1, 1, 1), seed=11)
  out, new_state = gk_prefill.gdn_prefill(**x, config=SMALL_PREFILL, interpret=True)
  dec = {
    n: x[n][:, None] if n in ("q", "k", "v", "a", "b") else x[n]
    for n in ("q", "k", "v", "state", "A_log", "a", "dt_bias", "b", "scale")
  }
  dec_out, dec_state = gk_decode.gdn_decode(**dec, config=WHOLE_HEAD, interpret=True)
  assert_bf16_close(out, dec_out[:, 0])
  assert_f32_close(new_state, dec_state)


def test_heuristic_grids():
  """Two waves on 132 SMs at the recorded T=5709 with two sequences (the
  launches parallel over chunks); the serial form where T <= 32."""
  op = registry.get(PREFILL)
  axes = {"total_seq_len": 5709, "num_seqs": 2, "len_cu_seqlens": 3}
  calls = kit.lowered_calls(op, axes, op.choose_config(op.input_shapes(axes)))
  assert max(math.prod(c.grid) for c in calls) >= 2 * 132, calls
  for t, form in ((6, "serial"), (32, "serial"), (33, "chunked"), (8192, "chunked")):
    assert op.choose_config(op.input_shapes({"total_seq_len": t, "num_seqs": 1, "len_cu_seqlens": 2})).form == form


@pytest.mark.device_stack
def test_chunked_launches_move_each_intermediate_once():
  """The heuristic's chunked forward at two long sequences: the launches'
  buffers (operands and results) add up to the op's inputs and outputs,
  what launches re-read of q, k, v and the gates, and G, W, U, V' (fp32)
  and the chunk states (bf16) each written once and read once."""
  op = registry.get(PREFILL)
  axes = {"total_seq_len": 5709, "num_seqs": 2, "len_cu_seqlens": 3}
  shapes = op.input_shapes({**axes, **CONST})
  config = op.choose_config(shapes)
  assert config.form == "chunked"
  txt = lower_for_h100(lambda x: gk_prefill.gdn_prefill(**x, config=config, interpret=False), shapes)
  calls = triton_buffers(txt)
  assert [c.name for c in calls] == ["gdn_prefill_intra", "gdn_prefill_state", "gdn_prefill_output"]
  size = lambda x: math.prod(x.shape) * x.dtype.itemsize  # noqa: E731
  t, n, hv, d = axes["total_seq_len"], axes["num_seqs"], CONST["num_v_heads"], CONST["head_size"]
  slots = t // config.chunk + n + 2
  outputs = t * hv * d * 2 + n * hv * d * d * 4
  io = sum(size(x) for name, x in shapes.items() if name != "cu_seqlens") + outputs
  g, rows, states = t * hv * 4, t * hv * d * 4, slots * hv * d * d * 2  # G; W, U, V'; H
  tables = 5 * slots * 4 + (2 * n + 1) * 4  # the chunk table's arrays
  # k is read by all three launches, G by two.
  expected = io + 2 * size(shapes["k"]) + 3 * g + 2 * (3 * rows + states) + tables
  total = sum(c.operand_bytes + c.result_bytes for c in calls)
  assert total <= expected, (total, expected, calls)


def test_prefill_everything_empty():
  x = prefill_inputs((0, 0), seed=1)
  out, new_state = gk_prefill.gdn_prefill(**x, interpret=True)
  assert out.shape == (0, 8, 128) and np.all(np.asarray(new_state) == 0)
  ref_out, ref_state = fam_prefill.gdn_prefill_reference(**x)
  assert ref_out.shape == (0, 8, 128) and np.all(np.asarray(ref_state) == 0)


# ------------------------------------------- cu_seqlens outside the contract


@pytest.mark.parametrize("config", [SMALL_PREFILL, SMALL_SERIAL], ids=lambda c: c.form)
def test_cu_seqlens_outside_the_contract(config):
  """Bounds past T, negative or decreasing mean their clamped running
  maximum on both paths (`gdn_chunks.normalize_cu_seqlens`): the kernel
  gives exactly what it gives on the normalized bounds (no NaN from rows
  past T), zero outputs for tokens of no sequence, and the reference's
  answer. The serial form runs where T <= 32."""
  total = 30 if config.form == "serial" else 50
  x = prefill_inputs((total, 0, 0), seed=13, scale=1.0)
  bad = jnp.array([3, total + 40, -2, 12], jnp.int32)
  good = jnp.array([3, total, total, total], jnp.int32)
  out, new_state = gk_prefill.gdn_prefill(**{**x, "cu_seqlens": bad}, config=config, interpret=True)
  want_out, want_state = gk_prefill.gdn_prefill(**{**x, "cu_seqlens": good}, config=config, interpret=True)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
  np.testing.assert_array_equal(np.asarray(new_state), np.asarray(want_state))
  assert np.all(np.asarray(out[:3], np.float32) == 0) and np.all(np.asarray(new_state[1:]) == 0)
  ref_out, ref_state = fam_prefill.gdn_prefill_reference(**{**x, "cu_seqlens": bad})
  assert_bf16_close(out, ref_out)
  assert state_errors(new_state, ref_state)[0] < 1e-4


# ---------------------------------------------------------------- gradients


DIFFERENTIABLE = ("q", "k", "v", "state", "A_log", "a", "dt_bias", "b")
WITH_SCALE = (*DIFFERENTIABLE, "scale")
RECOMPUTED = ("gdn_prefill_intra", "gdn_prefill_state")
BACKWARD_KERNELS = ("gdn_prefill_bwd_dv", "gdn_prefill_bwd_state", "gdn_prefill_bwd_chunk", "gdn_prefill_bwd_dqk")


def weighted_loss(fn, weights):
  """sum(out * weights[0]) + sum(new_state * weights[1]) of `fn(*args)`,
  which returns (out, new_state)."""
  w_out, w_state = weights

  def f(*args):
    out, new_state = fn(*args)
    return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(new_state * w_state)

  return f


def output_weights(x):
  """Fixed random weights of both outputs for the inputs `x`."""
  return gradients.weights_like(x["v"].shape, 1), gradients.weights_like(x["state"].shape, 2)


def op_loss(backend, cu_seqlens, weights):
  """Weighted sum of both outputs of the public op on `backend`."""
  return weighted_loss(lambda *args: ops.gdn_prefill(*args, cu_seqlens, sm_scale=1.0, backend=backend), weights)


def test_gradients_of_both_paths_agree_under_jit():
  """Every floating input (state and gate parameters included) on ragged
  sequences (an empty one, a partial chunk): the Pallas path (chunked
  forward and backward kernels, interpret mode) against the XLA path, both
  under jit(grad); the gradient's jaxpr runs the forward's launches and the
  four backward launches."""
  lengths = (45, 0, 20)
  x = prefill_inputs(lengths, seed=17)
  args = tuple(x[n] for n in DIFFERENTIABLE)
  weights = output_weights(x)
  argnums = tuple(range(len(args)))
  pallas = jax.jit(jax.grad(op_loss("pallas", x["cu_seqlens"], weights), argnums))(*args)
  xla = jax.jit(jax.grad(op_loss("xla", x["cu_seqlens"], weights), argnums))(*args)
  gradients.assert_grads_close(pallas, xla, DIFFERENTIABLE)
  assert np.all(np.asarray(pallas[3][1]) == 0)  # the empty sequence's state
  assert all(np.abs(np.asarray(g, np.float32)).max() > 0 for g in pallas)
  names = gradients.pallas_calls(jax.grad(op_loss("pallas", x["cu_seqlens"], weights)), *args)
  assert {"gdn_prefill_output", *RECOMPUTED, *BACKWARD_KERNELS} <= set(names), names


def test_nan_in_tokens_of_no_sequence_reaches_no_gradient():
  """Tokens before cu_seqlens[0] and after cu_seqlens[N] hold NaN: the XLA
  path's outputs there are 0 and every gradient is finite (the reference
  zeroes them before its scan, so where's unselected branch holds no NaN)."""
  x = prefill_inputs((40,), seed=19)
  for name in ("q", "k", "v", "a", "b"):
    x[name] = x[name].at[:3].set(jnp.nan).at[-4:].set(jnp.nan)
  cu = jnp.array([3, 36], jnp.int32)
  weights = output_weights(x)
  args = tuple(x[n] for n in DIFFERENTIABLE)
  out, _ = ops.gdn_prefill(*args, cu, sm_scale=1.0, backend="xla")
  assert np.all(np.asarray(out[:3], np.float32) == 0) and np.all(np.isfinite(np.asarray(out, np.float32)))
  grads = jax.jit(jax.grad(op_loss("xla", cu, weights), tuple(range(len(args)))))(*args)
  for name, g in zip(DIFFERENTIABLE, grads):
    assert np.all(np.isfinite(np.asarray(g, np.float32))), name


# Large blocks (few programs in interpret mode) unless a case is about blocks.
SMALL_BWD = gk_bwd.GdnPrefillBwdConfig(
  dv=gk_bwd.DvStage(block_v=128),
  state=gk_bwd.StateBwdStage(block_v=128),
  chunk_grads=gk_bwd.ChunkBwdStage(block_v=64),
  dqk=gk_bwd.DqkStage(block_k=128, block_v=64),
)


def with_backward(config, backward=SMALL_BWD):
  return dataclasses.replace(config, backward=backward)


def kernel_and_reference(x, config):
  """(kernel, reference) as functions of the WITH_SCALE inputs."""
  cu = x["cu_seqlens"]
  kernel = lambda *a: gk_prefill.gdn_prefill(*a[:8], cu, a[8], config=config, interpret=True)  # noqa: E731
  reference = lambda *a: fam_prefill.gdn_prefill_reference(*a[:8], cu, a[8])  # noqa: E731
  return kernel, reference


def assert_kernel_grads_match_reference(x, config):
  kernel, reference = kernel_and_reference(x, config)
  args, argnums = tuple(x[n] for n in WITH_SCALE), tuple(range(len(WITH_SCALE)))
  got = jax.jit(jax.grad(weighted_loss(kernel, output_weights(x)), argnums))(*args)
  want = jax.jit(jax.grad(weighted_loss(reference, output_weights(x)), argnums))(*args)
  gradients.assert_grads_close(got, want, WITH_SCALE)
  return got


def _gap_tokens():
  """Tokens before cu_seqlens[0] and after cu_seqlens[N] hold NaN."""
  x = prefill_inputs((40,), seed=19, scale=0.6)
  for name in ("q", "k", "v", "a", "b"):
    x[name] = x[name].at[:3].set(jnp.nan).at[-4:].set(jnp.nan)
  x["cu_seqlens"] = jnp.array([3, 36], jnp.int32)
  return x


GRAD_CASES = {
  # Chunk boundaries (1, 63, 64, 65 tokens), empty sequences, a ragged third chunk; the heuristic's blocks.
  "chunk_boundaries_default_blocks": (
    lambda: prefill_inputs(BOUNDARY_LENGTHS, seed=7, scale=0.9),
    with_backward(SMALL_PREFILL, gk_bwd.GdnPrefillBwdConfig()),
  ),
  # The serial forward (T <= 32): the backward recomputes the chunked form.
  "serial_forward": (lambda: prefill_inputs((5, 0, 9), seed=3, scale=1.1), with_backward(SMALL_SERIAL)),
  "chunk32_other_blocks": (
    lambda: prefill_inputs((70, 1, 33), seed=8, scale=1.0),
    with_backward(
      SMALL_PREFILL,
      gk_bwd.GdnPrefillBwdConfig(
        chunk=32,
        dv=gk_bwd.DvStage(block_v=32),
        state=gk_bwd.StateBwdStage(block_v=16),
        chunk_grads=gk_bwd.ChunkBwdStage(block_v=32, solve_block=32),
        dqk=gk_bwd.DqkStage(block_k=64, block_v=16),
      ),
    ),
  ),
  # Near-duplicate keys, beta ~ 1, no decay: the hardest case for the WY solve's backward.
  "correlated_keys": (correlated_keys, with_backward(SMALL_PREFILL)),
  "nan_in_tokens_of_no_sequence": (_gap_tokens, with_backward(SMALL_PREFILL)),
}


@pytest.mark.parametrize("case", GRAD_CASES)
def test_kernel_gradients_match_the_reference_under_jit(case):
  """Every floating input, `scale` included, through the backward kernels
  (interpret mode) against the reference's VJP, both under jit."""
  make, config = GRAD_CASES[case]
  x = make()
  got = assert_kernel_grads_match_reference(x, config)
  if case == "nan_in_tokens_of_no_sequence":  # zero gradients there, and no NaN anywhere
    for name, g in zip(WITH_SCALE, got):
      if g.ndim and g.shape[0] == 40:
        assert np.all(np.asarray(g[:3], np.float32) == 0) and np.all(np.asarray(g[-4:], np.float32) == 0), name


def assert_finite_differences(grad_of, lengths, head_size, rtol):
  """`grad_of(cu_seqlens, weights, *inputs)` (gradients of sum(out *
  weights[0]) + sum(new_state * weights[1]) for the float32 DIFFERENTIABLE
  inputs, scale 1) against central differences of the float64 recurrence
  (test_gdn_decode.numpy_gdn); one q/k head, two v heads."""
  rng = np.random.default_rng(5)
  total, n, hq, hv, d = sum(lengths), len(lengths), 1, 2, head_size
  x64 = {
    "q": rng.standard_normal((total, hq, d)) * 0.3,
    "k": rng.standard_normal((total, hq, d)) * 0.3,
    "v": rng.standard_normal((total, hv, d)),
    "state": rng.standard_normal((n, hv, d, d)) * 0.5,
    "A_log": rng.uniform(-2.0, 0.0, hv),
    "a": rng.standard_normal((total, hv)),
    "dt_bias": rng.uniform(-1.0, 0.5, hv),
    "b": rng.standard_normal((total, hv)),
  }
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
  weights = (gradients.weights_like((total, hv, d), 3), gradients.weights_like((n, hv, d, d), 4))
  got = grad_of(cu, weights, *(jnp.asarray(x64[k], jnp.float32) for k in DIFFERENTIABLE))

  def fn64(*values):  # the float64 loss as one weighted output: outputs and states side by side
    out, new_state = numpy_gdn({**dict(zip(DIFFERENTIABLE, values)), "scale": 1.0}, lengths)
    return np.concatenate([out.ravel(), new_state.ravel()])

  w64 = np.concatenate([np.asarray(w, np.float64).ravel() for w in weights])
  want = gradients.finite_difference_grads(fn64, [x64[k] for k in DIFFERENTIABLE], w64)
  for name, g, w in zip(DIFFERENTIABLE, got, want):
    np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=rtol, atol=rtol * np.abs(w).max(), err_msg=name)


def test_kernel_gradients_match_float64_finite_differences():
  """Through the backward kernels (interpret mode, chunk 16, so that the
  sequences of 21 and 9 tokens span several chunks, one partial; an empty
  one); 1e-2: the output is rounded to bf16 once, as the forward's."""
  config = gk_prefill.GdnPrefillConfig(
    chunk=16,
    backward=gk_bwd.GdnPrefillBwdConfig(
      chunk=16,
      dv=gk_bwd.DvStage(block_v=16),
      state=gk_bwd.StateBwdStage(block_v=16),
      chunk_grads=gk_bwd.ChunkBwdStage(block_v=16),
      dqk=gk_bwd.DqkStage(block_k=16, block_v=16),
    ),
  )

  def grad_of(cu, weights, *args):
    loss = weighted_loss(lambda *a: gk_prefill.gdn_prefill(*a, cu, 1.0, config=config, interpret=True), weights)
    return jax.grad(loss, tuple(range(len(args))))(*args)

  assert_finite_differences(grad_of, (21, 0, 9), head_size=16, rtol=1e-2)


def test_xla_gradients_match_float64_finite_differences():
  """The XLA path (the reference's scan) on sequences of 2, 0 and 3 tokens."""

  def grad_of(cu, weights, *args):
    return jax.grad(op_loss("xla", cu, weights), tuple(range(len(args))))(*args)

  assert_finite_differences(grad_of, (2, 0, 3), head_size=4, rtol=2e-3)


def backward_launches(axes):
  """The gradient's launches for the heuristic's config: the forward (its
  form), launches 1-2 recomputed at the backward's chunk, and the four
  backward launches (grids over chunk slots, sequences, V and K blocks)."""
  shapes = registry.get(PREFILL).input_shapes({**axes, **CONST})
  config = gk_prefill.choose_config(shapes)
  bwd = config.backward
  t, n, hv, d = (axes.get(a, CONST.get(a)) for a in ("total_seq_len", "num_seqs", "num_v_heads", "head_size"))
  slots = t // bwd.chunk + n + 2
  recomputed = launches(dataclasses.replace(config, form="chunked", chunk=bwd.chunk), {**axes, **CONST})[:2]
  call = lambda name, grid, stage: TritonCall(name, grid, stage.num_warps, stage.num_stages)  # noqa: E731
  return [
    *launches(config, {**axes, **CONST}),
    *recomputed,
    call("gdn_prefill_bwd_dv", (slots, hv, d // bwd.dv.block_v), bwd.dv),
    call("gdn_prefill_bwd_state", (n, hv, d // bwd.state.block_v), bwd.state),
    call("gdn_prefill_bwd_chunk", (slots, hv, 1), bwd.chunk_grads),
    call("gdn_prefill_bwd_dqk", (slots, hv, d // bwd.dqk.block_k), bwd.dqk),
  ]


@pytest.mark.device_stack
@pytest.mark.parametrize("t,n", [(8192, 57), (8192, 1), (6, 1)], ids=lambda v: str(v))
def test_gradient_lowers_for_h100(t, n):
  """jax.grad of the kernel (every floating input) lowers for an abstract
  H100 with the heuristic's launches: the largest record, one long
  sequence, and a prefill short enough for the serial forward."""
  axes = {"total_seq_len": t, "num_seqs": n, "len_cu_seqlens": n + 1}
  shapes = registry.get(PREFILL).input_shapes({**axes, **CONST})
  floating = [name for name in WITH_SCALE if name != "scale"]

  def loss(cu_seqlens, *values):
    out, new_state = gk_prefill.gdn_prefill(**dict(zip(floating, values)), cu_seqlens=cu_seqlens, interpret=False)
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(new_state)

  grad = jax.value_and_grad(loss, tuple(range(1, len(floating) + 1)))  # the value keeps the forward
  calls = triton_calls(lower_for_h100(grad, shapes["cu_seqlens"], *(shapes[name] for name in floating)))
  assert sorted(calls) == sorted(backward_launches(axes))


# ---------------------------------------------------------------- synthesis


def test_prefill_synthesis_lengths():
  axes = dict(total_seq_len=8192, num_seqs=57, len_cu_seqlens=58, **CONST)
  x = fam_prefill.make_prefill_inputs(axes, jax.random.key(3), record={"axes": axes})
  check_against_definition(PREFILL, x, axes)
  cu = np.asarray(x["cu_seqlens"])
  assert cu[0] == 0 and cu[-1] == 8192 and np.all(np.diff(cu) >= 1)
  y = fam_prefill.make_prefill_inputs(axes, jax.random.key(3))
  np.testing.assert_array_equal(cu, np.asarray(y["cu_seqlens"]))
  # Fewer tokens than sequences: empty sequences only as many as forced.
  lengths = fam_prefill.split_lengths(5, 8, seed=0)
  assert sorted(lengths.tolist()) == [0, 0, 0, 1, 1, 1, 1, 1]
  assert fam_prefill.split_lengths(3, 3, seed=1).tolist() == [1, 1, 1]
  assert fam_prefill.split_lengths(0, 2, seed=1).tolist() == [0, 0]


def test_cpu_axes_keep_structure():
  for axes in recorded_axes(PREFILL):
    small = fam_prefill.prefill_cpu_axes({**axes, **CONST})
    assert small["len_cu_seqlens"] == small["num_seqs"] + 1
    assert (
      small["total_seq_len"] <= 256
      and small["total_seq_len"] % 64 == axes["total_seq_len"] % 64
      or small["total_seq_len"] == axes["total_seq_len"]
    )
    assert small["total_seq_len"] >= small["num_seqs"] and small["num_seqs"] >= min(axes["num_seqs"], 4)
    assert {k: small[k] for k in CONST} == CONST
