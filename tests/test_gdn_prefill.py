"""Gated delta net chunked prefill (SPEC 4.8): the kit's data (launches;
edge cases for the kernel in interpret mode: chunk boundaries, empty
sequences, 64 sequences, other blockings, correlated keys; lowering of one
long sequence) and the family's own checks: the reference against the
float64 NumPy recurrence of test_gdn_decode.py, independence of packed
sequences, the one-token case against decode, input synthesis and CPU axes.
(The checks themselves: test_definitions.py and kit.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkern.families import gdn_prefill as fam_prefill
from kit import Case, TritonCall
from pallas_kernels import gdn_decode as gk_decode
from pallas_kernels import gdn_prefill as gk_prefill
from numerics import assert_bf16_close, assert_f32_close
from test_gdn_decode import CONST, WHOLE_HEAD, check_against_definition, numpy_gdn, recorded_axes

PREFILL = "gdn_prefill_qk4_v8_d128_k_last"


def prefill_inputs(lengths, seed=0, scale=0.0):
  """Synthesized inputs with the given sequence lengths."""
  total, n = int(sum(lengths)), len(lengths)
  x = fam_prefill.make_prefill_inputs(dict(total_seq_len=total, num_seqs=n, len_cu_seqlens=n + 1, **CONST),
                                      jax.random.key(seed))
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
  rel_rms = np.sqrt((e ** 2).mean() / (y ** 2).mean())
  rel_max = np.abs(e).max() / np.abs(y).max()
  head_ref = (y ** 2).mean(axis=(2, 3))
  assert np.all(e[head_ref == 0] == 0)
  head = np.sqrt((e ** 2).mean(axis=(2, 3))[head_ref > 0] / head_ref[head_ref > 0])
  return rel_rms, rel_max, head.max(initial=0.0)


def launches(config, axes):
  """Grid (sequences, HV, V blocks)."""
  d = axes["head_size"]
  return [TritonCall("gdn_prefill", (axes["num_seqs"], axes["num_v_heads"], d // min(config.block_v, d)),
                     config.num_warps, config.num_stages)]


# One V block per head: fewest programs in interpret mode (each copies the
# state buffer); other blockings are cases of their own.
SMALL_PREFILL = gk_prefill.GdnPrefillConfig(chunk=64, block_v=128)


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


def _sixty_four_lengths():
  lengths = np.random.default_rng(0).integers(0, 4, 64)
  lengths[5] = 0
  return lengths


KERNEL_CASES = [
    *(Case(PREFILL, inputs=lambda lengths=lengths: prefill_inputs(lengths, seed=len(lengths), scale=1.0),
           config=SMALL_PREFILL, check=close_to_the_recurrence(lengths), id=label)
      for lengths, label in [((1, 63, 64, 65), "every_chunk_boundary"), ((40, 0, 90), "empty_inside"),
                             ((0, 17), "empty_first"), ((130,), "three_chunks_ragged_last")]),
    Case(PREFILL, inputs=lambda: prefill_inputs(_sixty_four_lengths(), seed=64),
         config=gk_prefill.GdnPrefillConfig(block_v=128), id="sixty_four_sequences"),
    *(Case(PREFILL, inputs=lambda: prefill_inputs((70, 1, 33), seed=8, scale=1.0), config=config,
           id=f"chunk{config.chunk}_block_v{config.block_v}_{config.dot_precision}")
      for config in (gk_prefill.GdnPrefillConfig(chunk=32, block_v=64),
                     gk_prefill.GdnPrefillConfig(chunk=16, block_v=32),
                     gk_prefill.GdnPrefillConfig(chunk=64, block_v=32, dot_precision="bf16"))),
    Case(PREFILL, inputs=correlated_keys, config=gk_prefill.GdnPrefillConfig(chunk=32, block_v=128),
         check=state_within_rounding_noise, id="correlated_keys"),
]
LOWERING_CASES = [Case(PREFILL, {"total_seq_len": 8192, "num_seqs": 1, "len_cu_seqlens": 2},
                       id="one_long_sequence")]


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
  """A packed sequence sees neither its neighbours' tokens nor their states."""
  lengths = (50, 70)
  x = prefill_inputs(lengths, seed=3, scale=1.0)
  out, new_state = gk_prefill.gdn_prefill(**x, config=SMALL_PREFILL, interpret=True)
  second = {**x, "q": x["q"][50:], "k": x["k"][50:], "v": x["v"][50:], "a": x["a"][50:],
            "b": x["b"][50:], "state": x["state"][1:], "cu_seqlens": jnp.array([0, 70], jnp.int32)}
  out2, state2 = gk_prefill.gdn_prefill(**second, config=SMALL_PREFILL, interpret=True)
  np.testing.assert_array_equal(np.asarray(out[50:], np.float32), np.asarray(out2, np.float32))
  np.testing.assert_array_equal(np.asarray(new_state[1]), np.asarray(state2[0]))


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
