"""Tests of the gated delta net family (SPEC 4.8): the decode and chunked
prefill kernels in interpret mode against the sequential fp32 references, the
references against a float64 NumPy recurrence, input synthesis, CPU axes and
deviceless H100 lowering of every candidate config at the largest recorded
sizes."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkern.families import gdn_decode as fam_decode
from jaxkern.families import gdn_prefill as fam_prefill
from pallas_kernels import gdn_decode as gk_decode
from pallas_kernels import gdn_prefill as gk_prefill
from pallas_kernels.common import assert_lowers_to_triton
from numerics import assert_bf16_close

DECODE = "gdn_decode_qk4_v8_d128_k_last"
PREFILL = "gdn_prefill_qk4_v8_d128_k_last"
CONST = dict(num_q_heads=4, num_k_heads=4, num_v_heads=8, head_size=128)
_DATASET = os.path.join(os.path.dirname(__file__), os.pardir, "datasets")


def definition(name):
  with open(os.path.join(_DATASET, "definitions", f"{name}.json")) as f:
    return json.load(f)


def recorded_axes(name):
  with open(os.path.join(_DATASET, "workloads", f"{name}.jsonl")) as f:
    return [json.loads(line)["axes"] for line in f if line.strip()]


def decode_inputs(batch, seed=0):
  return fam_decode.make_decode_inputs(dict(batch_size=batch, seq_len=1, **CONST), jax.random.key(seed))


def prefill_inputs(lengths, seed=0, scale=0.0):
  """Synthesized inputs with the given sequence lengths."""
  total, n = int(sum(lengths)), len(lengths)
  x = fam_prefill.make_prefill_inputs(dict(total_seq_len=total, num_seqs=n, len_cu_seqlens=n + 1, **CONST),
                              jax.random.key(seed))
  x["cu_seqlens"] = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
  x["scale"] = jnp.float32(scale)
  return x


def assert_f32_close(actual, desired):
  """SPEC 5 f32 rule: atol 2e-5, rtol 1e-4 (FIB: fails only if both exceed)."""
  x, y = np.asarray(actual, np.float32), np.asarray(desired, np.float32)
  assert x.shape == y.shape and np.all(np.isfinite(x))
  err = np.abs(x - y)
  bad = (err > 2e-5) & (err > 1e-4 * np.abs(y))
  assert not bad.any(), f"{bad.sum()} f32 mismatches, max abs err {err.max()}"


def state_errors(actual, desired):
  """(relative RMS, relative max, worst per-(sequence, head) relative RMS):
  the gdn_prefill_state metric of SPEC 5. All-zero reference rows (empty
  sequences) must be matched exactly and are left out of the per-head term."""
  x, y = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
  assert x.shape == y.shape and np.all(np.isfinite(x))
  e = x - y
  rel_rms = np.sqrt((e ** 2).mean() / (y ** 2).mean())
  rel_max = np.abs(e).max() / np.abs(y).max()
  head_ref = (y ** 2).mean(axis=(2, 3))
  assert np.all(e[head_ref == 0] == 0)
  head = np.sqrt((e ** 2).mean(axis=(2, 3))[head_ref > 0] / head_ref[head_ref > 0])
  return rel_rms, rel_max, head.max(initial=0.0)


def assert_state_metric(actual, desired):
  rel_rms, rel_max, head = state_errors(actual, desired)
  assert rel_rms <= 0.01 and rel_max <= 0.015 and head <= 0.02, (rel_rms, rel_max, head)


# ------------------------------------------------------- float64 NumPy model


def numpy_gdn(x, lengths):
  """Independent float64 recurrence, token by token (prefill layout; decode
  is the one-token case). Returns (output [T, HV, D], new_state [N, HV, V, K])."""
  f64 = lambda name: np.asarray(x[name], np.float64)
  q, k, v, a, b = f64("q"), f64("k"), f64("v"), f64("a"), f64("b")
  a_log, dt_bias, state = f64("A_log"), f64("dt_bias"), f64("state")
  hq, hv, d = q.shape[1], v.shape[1], q.shape[2]
  scale = float(x["scale"]) or 1.0 / np.sqrt(d)
  out = np.zeros(v.shape)
  new_state = np.zeros(state.shape)
  t = 0
  for n, length in enumerate(lengths):
    s = state[n].transpose(0, 2, 1).copy()                      # [HV, K, V]
    for _ in range(length):
      for h in range(hv):
        x_ = a[t, h] + dt_bias[h]
        softplus = x_ if x_ > 20 else np.log1p(np.exp(x_))
        g = np.exp(-np.exp(a_log[h]) * softplus)
        beta = 1.0 / (1.0 + np.exp(-b[t, h]))
        kk, qq = k[t, h // (hv // hq)], q[t, h // (hv // hq)]
        s[h] *= g
        s[h] += np.outer(kk, beta * (v[t, h] - kk @ s[h]))
        out[t, h] = scale * (qq @ s[h])
      t += 1
    if length:
      new_state[n] = s.transpose(0, 2, 1)
  return out, new_state


def test_decode_reference_matches_float64():
  x = decode_inputs(3, seed=4)
  out, new_state = fam_decode.gdn_decode_reference(**x)
  flat = {n: (v[:, 0] if n in ("q", "k", "v", "a", "b") else v) for n, v in x.items()}
  want_out, want_state = numpy_gdn(flat, [1, 1, 1])
  assert_bf16_close(out[:, 0], want_out)
  np.testing.assert_allclose(np.asarray(new_state), want_state, rtol=1e-5, atol=1e-5)


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


def test_references_follow_the_definitions():
  assert definition(DECODE)["reference"] == "jaxkern.families.gdn_decode:gdn_decode_reference"
  assert definition(PREFILL)["reference"] == "jaxkern.families.gdn_prefill:gdn_prefill_reference"
  for name in (DECODE, PREFILL):
    d = definition(name)
    fn = getattr(fam_decode if name == DECODE else fam_prefill, d["reference"].split(":")[1])
    assert list(fn.__code__.co_varnames[:fn.__code__.co_argcount]) == list(d["inputs"])
    kernel = gk_decode.gdn_decode if name == DECODE else gk_prefill.gdn_prefill
    params = list(kernel.__wrapped__.__code__.co_varnames[:len(d["inputs"])])
    assert params == list(d["inputs"])


# ------------------------------------------------------------------- decode


@pytest.mark.parametrize("batch,block_v", [(1, 16), (3, 32), (64, 128)])
def test_decode_kernel_matches_reference(batch, block_v):
  x = decode_inputs(batch, seed=batch)
  out, new_state = gk_decode.gdn_decode(**x, config=gk_decode.GdnDecodeConfig(block_v=block_v), interpret=True)
  want_out, want_state = fam_decode.gdn_decode_reference(**x)
  assert out.dtype == jnp.bfloat16 and new_state.dtype == jnp.float32
  assert_bf16_close(out, want_out)
  assert_f32_close(new_state, want_state)


WHOLE_HEAD = gk_decode.GdnDecodeConfig(block_v=128)


def test_decode_scale():
  x = decode_inputs(2, seed=9)
  default = gk_decode.gdn_decode(**x, config=WHOLE_HEAD, interpret=True)[0]
  explicit = gk_decode.gdn_decode(**{**x, "scale": jnp.float32(128 ** -0.5)}, config=WHOLE_HEAD,
                           interpret=True)[0]
  np.testing.assert_array_equal(np.asarray(default, np.float32), np.asarray(explicit, np.float32))
  x["scale"] = jnp.float32(1.0)
  out = gk_decode.gdn_decode(**x, config=WHOLE_HEAD, interpret=True)[0]
  assert_bf16_close(out, fam_decode.gdn_decode_reference(**x)[0])
  assert np.abs(np.asarray(out, np.float32)).max() > 4 * np.abs(np.asarray(default, np.float32)).max()


def test_decode_scale_traced_under_jit():
  x = decode_inputs(2, seed=10)
  f = jax.jit(lambda s: gk_decode.gdn_decode(**{**x, "scale": s}, config=WHOLE_HEAD, interpret=True)[0])
  assert_bf16_close(f(jnp.float32(0.5)), fam_decode.gdn_decode_reference(**{**x, "scale": 0.5})[0])


# ------------------------------------------------------------------ prefill

# One V block per head: fewest programs in interpret mode (each copies the
# state buffer); other blockings are covered by test_prefill_configs.
SMALL_PREFILL = gk_prefill.GdnPrefillConfig(chunk=64, block_v=128)


@pytest.mark.parametrize("lengths", [
    (1, 63, 64, 65),        # every chunk-boundary case
    (40, 0, 90),            # an empty sequence inside cu_seqlens
    (0, 17),                # empty first
    (130,),                 # one sequence, three chunks, ragged last
])
def test_prefill_kernel_matches_reference(lengths):
  x = prefill_inputs(lengths, seed=len(lengths), scale=1.0)  # scale 1: outputs O(1)
  out, new_state = gk_prefill.gdn_prefill(**x, config=SMALL_PREFILL, interpret=True)
  want_out, want_state = fam_prefill.gdn_prefill_reference(**x)
  assert out.dtype == jnp.bfloat16 and new_state.dtype == jnp.float32
  assert np.abs(np.asarray(want_out, np.float32)).max() > 0.5
  assert_bf16_close(out, want_out)
  assert_state_metric(new_state, want_state)
  # bf16x3 dots keep the chunked state within f32 rounding noise of the recurrence.
  assert state_errors(new_state, want_state)[0] < 1e-4
  for n, length in enumerate(lengths):
    if not length:
      assert np.all(np.asarray(new_state[n]) == 0)


def test_prefill_64_sequences():
  lengths = np.random.default_rng(0).integers(0, 4, 64)
  lengths[5] = 0
  x = prefill_inputs(lengths, seed=64)
  out, new_state = gk_prefill.gdn_prefill(**x, config=gk_prefill.GdnPrefillConfig(block_v=128), interpret=True)
  want_out, want_state = fam_prefill.gdn_prefill_reference(**x)
  assert_bf16_close(out, want_out)
  assert_state_metric(new_state, want_state)


def test_prefill_sequences_are_independent():
  """A packed sequence sees neither its neighbours' tokens nor their states."""
  lengths = (50, 70)
  x = prefill_inputs(lengths, seed=3, scale=1.0)
  out, new_state = gk_prefill.gdn_prefill(**x, config=SMALL_PREFILL, interpret=True)
  second = {**x, "q": x["q"][50:], "k": x["k"][50:], "v": x["v"][50:], "a": x["a"][50:],
            "b": x["b"][50:], "state": x["state"][1:], "cu_seqlens": jnp.array([0, 70], jnp.int32)}
  out2, state2 = gk_prefill.gdn_prefill(**second, config=SMALL_PREFILL, interpret=True)
  np.testing.assert_array_equal(np.asarray(out[50:], np.float32), np.asarray(out2, np.float32))
  np.testing.assert_array_equal(np.asarray(new_state[1]), np.asarray(state2[0]))


@pytest.mark.parametrize("config", [
    gk_prefill.GdnPrefillConfig(chunk=32, block_v=64),
    gk_prefill.GdnPrefillConfig(chunk=16, block_v=32),
    gk_prefill.GdnPrefillConfig(chunk=64, block_v=32, dot_precision="bf16"),
])
def test_prefill_configs(config):
  x = prefill_inputs((70, 1, 33), seed=8, scale=1.0)
  out, new_state = gk_prefill.gdn_prefill(**x, config=config, interpret=True)
  want_out, want_state = fam_prefill.gdn_prefill_reference(**x)
  assert_bf16_close(out, want_out)
  assert_state_metric(new_state, want_state)


def test_prefill_correlated_keys():
  """Near-duplicate keys, beta ~ 1, no decay: the hardest case for the WY
  solve and for the split dots (single-bf16 dots fail the output tolerance
  here)."""
  x = prefill_inputs((200,), seed=12, scale=1.0)
  base = jax.random.normal(jax.random.key(1), (1, 4, 128))
  keys = base + 0.15 * jax.random.normal(jax.random.key(2), (200, 4, 128))
  x["k"] = x["q"] = (keys / jnp.linalg.norm(keys, axis=-1, keepdims=True)).astype(jnp.bfloat16)
  x["b"] = jnp.full((200, 8), 4.0, jnp.bfloat16)
  x["a"] = jnp.full((200, 8), -8.0, jnp.bfloat16)
  out, new_state = gk_prefill.gdn_prefill(**x, config=gk_prefill.GdnPrefillConfig(chunk=32, block_v=128),
                                  interpret=True)
  want_out, want_state = fam_prefill.gdn_prefill_reference(**x)
  assert_bf16_close(out, want_out)
  assert state_errors(new_state, want_state)[0] < 1e-4


def test_prefill_single_token_matches_decode():
  x = prefill_inputs((1, 1, 1), seed=11)
  out, new_state = gk_prefill.gdn_prefill(**x, config=SMALL_PREFILL, interpret=True)
  dec = {n: x[n][:, None] if n in ("q", "k", "v", "a", "b") else x[n]
         for n in ("q", "k", "v", "state", "A_log", "a", "dt_bias", "b", "scale")}
  dec_out, dec_state = gk_decode.gdn_decode(**dec, config=WHOLE_HEAD, interpret=True)
  assert_bf16_close(out, dec_out[:, 0])
  assert_f32_close(new_state, dec_state)


def test_prefill_everything_empty():
  x = prefill_inputs((0, 0), seed=1)
  out, new_state = gk_prefill.gdn_prefill(**x, interpret=True)
  assert out.shape == (0, 8, 128) and np.all(np.asarray(new_state) == 0)
  ref_out, ref_state = fam_prefill.gdn_prefill_reference(**x)
  assert ref_out.shape == (0, 8, 128) and np.all(np.asarray(ref_state) == 0)


# ---------------------------------------------------------------- synthesis


def check_against_definition(name, inputs, axes):
  d = definition(name)
  full = {**{n: a.get("value") for n, a in d["axes"].items()}, **axes}
  assert list(inputs) == list(d["inputs"])
  for n, spec in d["inputs"].items():
    shape = () if spec["shape"] is None else tuple(full[a] for a in spec["shape"])
    assert inputs[n].shape == shape, n
    assert inputs[n].dtype == jnp.dtype(spec["dtype"]), n


def test_decode_synthesis():
  axes = dict(batch_size=64, seq_len=1, **CONST)
  x = fam_decode.make_decode_inputs(axes, jax.random.key(1))
  check_against_definition(DECODE, x, axes)
  y = fam_decode.make_decode_inputs(axes, jax.random.key(1))
  for n in x:
    np.testing.assert_array_equal(np.asarray(x[n], np.float32), np.asarray(y[n], np.float32))
  z = fam_decode.make_decode_inputs(axes, jax.random.key(2))
  assert not np.array_equal(np.asarray(x["v"], np.float32), np.asarray(z["v"], np.float32))
  for n in ("q", "k"):
    norms = np.linalg.norm(np.asarray(x[n], np.float32), axis=-1)
    np.testing.assert_allclose(norms, 1.0, atol=1e-2)
  g, beta = fam_decode.gates(x["a"], x["b"], x["A_log"], x["dt_bias"])
  g, beta = np.asarray(g), np.asarray(beta)
  assert g.min() < 0.1 and g.max() > 0.95 and np.all((g > 0) & (g <= 1))
  assert beta.min() < 0.1 and beta.max() > 0.9
  assert float(x["scale"]) == 0.0


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
    assert small["total_seq_len"] <= 256 and small["total_seq_len"] % 64 == axes["total_seq_len"] % 64 \
        or small["total_seq_len"] == axes["total_seq_len"]
    assert small["total_seq_len"] >= small["num_seqs"] and small["num_seqs"] >= min(axes["num_seqs"], 4)
    assert {k: small[k] for k in CONST} == CONST
  for axes in recorded_axes(DECODE):
    small = fam_decode.decode_cpu_axes({**axes, "seq_len": 1, **CONST})
    assert 1 <= small["batch_size"] <= 8 and small["seq_len"] == 1


def test_cpu_scaled_workload_runs():
  axes = fam_prefill.prefill_cpu_axes(dict(total_seq_len=8192, num_seqs=57, len_cu_seqlens=58, **CONST))
  x = fam_prefill.make_prefill_inputs(axes, jax.random.key(0))
  out, new_state = gk_prefill.gdn_prefill(**x, config=SMALL_PREFILL, interpret=True)
  want_out, want_state = fam_prefill.gdn_prefill_reference(**x)
  assert_bf16_close(out, want_out)
  assert_state_metric(new_state, want_state)


# ----------------------------------------------------------------- lowering


def abstract(inputs_shapes):
  return {n: jax.ShapeDtypeStruct(s, d) for n, (s, d) in inputs_shapes.items()}


def prefill_avals(total, n):
  bf, f32 = jnp.bfloat16, jnp.float32
  return abstract(dict(q=((total, 4, 128), bf), k=((total, 4, 128), bf), v=((total, 8, 128), bf),
                       state=((n, 8, 128, 128), f32), A_log=((8,), f32), a=((total, 8), bf),
                       dt_bias=((8,), f32), b=((total, 8), bf), cu_seqlens=((n + 1,), jnp.int32),
                       scale=((), f32)))


def decode_avals(batch):
  bf, f32 = jnp.bfloat16, jnp.float32
  return abstract(dict(q=((batch, 1, 4, 128), bf), k=((batch, 1, 4, 128), bf),
                       v=((batch, 1, 8, 128), bf), state=((batch, 8, 128, 128), f32),
                       A_log=((8,), f32), a=((batch, 1, 8), bf), dt_bias=((8,), f32),
                       b=((batch, 1, 8), bf), scale=((), f32)))


def test_every_prefill_config_lowers_at_recorded_sizes():
  largest = max(recorded_axes(PREFILL), key=lambda a: (a["total_seq_len"], a["num_seqs"]))
  assert largest["total_seq_len"] == 8192
  for total, n in ((largest["total_seq_len"], largest["num_seqs"]), (8192, 1)):
    avals = prefill_avals(total, n)
    configs = gk_prefill.candidate_configs(avals)
    assert configs[0] == gk_prefill.choose_config(avals) and len(configs) >= 4
    for config in configs if n > 1 else configs[:1]:
      assert_lowers_to_triton(gk_prefill.gdn_prefill, *avals.values(), config=config, interpret=False)


def test_every_decode_config_lowers_at_recorded_sizes():
  for batch in sorted({a["batch_size"] for a in recorded_axes(DECODE)}):
    avals = decode_avals(batch)
    configs = gk_decode.candidate_configs(avals)
    assert configs[0] == gk_decode.choose_config(avals)
    for config in configs if batch == 64 else configs[:1]:
      assert_lowers_to_triton(gk_decode.gdn_decode, *avals.values(), config=config, interpret=False)
