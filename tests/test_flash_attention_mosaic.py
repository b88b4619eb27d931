"""The Mosaic GPU flash attention forward
(`pallas_kernels.flash_attention.mosaic_gpu`): interpret-mode runs against the
family's plain-jnp reference (SPEC 5 bf16 rule) and a jnp lse on ragged
sizes, key masks, prefix keys, block-causal segments, lonely rows, hidden
non-finite keys and values, d64 and d128 and every candidate; the checks on bad input; the H100 lowering of every
candidate at recorded sizes; and synchronization faults the interpreter
catches (its barrier checks, its race detector, on for every run here)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from mosaic_faults import assert_interpreter_reports, assert_race_detected
from numerics import assert_bf16_close, assert_f32_close

from jaxkern.families.flash_attention import attention_reference
from pallas_kernels.flash_attention import mosaic_gpu as fa
from pallas_kernels.shared.lowering import lower_for_h100
from pallas_kernels.shared.online_softmax import LOG2_E


def inputs(b, nq, nk, h, d, *, mask=False, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (b, nq, h, d), jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, nk, h, d), jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, nk, h, d), jnp.bfloat16)
  key_valid = jax.random.bernoulli(ks[3], 0.6, (b, nk)) if mask else None
  return q, k, v, key_valid


def bf16(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.bfloat16)


def lse_reference(q, k, key_valid=None, k_prefix=None, segment_ids=None):
  """log2 of sum exp(q.k * D**-0.5) over the visible keys (the prefix's,
  then k's), +inf for a row that sees none: [B, H, Nq]."""

  def scores(keys):
    return (
      jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), keys.astype(jnp.float32), precision=lax.Precision.HIGHEST)
      * q.shape[-1] ** -0.5
    )

  s = scores(k)
  visible = jnp.ones(s.shape, bool)
  if key_valid is not None:
    visible &= key_valid[:, None, None, :]
  if segment_ids is not None:
    visible &= segment_ids[:, None, None, :] <= segment_ids[:, None, :, None]
  s = jnp.where(visible, s, -jnp.inf)
  if k_prefix is not None:
    s = jnp.concatenate([scores(k_prefix), s], axis=-1)
  lse = jax.nn.logsumexp(s, axis=-1) * LOG2_E
  return jnp.where(jnp.isneginf(lse), jnp.inf, lse)


# The configs the interpret-mode tests below run with (None: the
# heuristic's); every candidate runs in the kit's sweep (test_definitions.py).
C = fa.MosaicAttentionConfig
RUN_CONFIGS = {
  "aligned": C(block_k=64, stages=4),
  "ragged_mask": C(block_k=128, stages=3),
  "lonely": C(block_k=64, stages=2),
  "heuristic": None,
}


def check(q, k, v, key_valid=None, config=None, **keys):
  """Runs the kernel and compares o (SPEC 5 bf16) and lse (f32 rule)."""
  o, lse = fa.flash_attention_forward(q, k, v, key_valid=key_valid, config=config, interpret=True, **keys)
  assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
  assert_bf16_close(o, attention_reference(q, k, v, key_valid=key_valid, **keys))
  assert_f32_close(lse, lse_reference(q, k, key_valid, keys.get("k_prefix"), keys.get("segment_ids")))
  return o, lse


def segments(batch, ends):
  """[B, N] int32 segment ids: segment s ends (exclusive) at ends[s]."""
  ids = jnp.searchsorted(jnp.asarray(ends), jnp.arange(ends[-1]), side="right").astype(jnp.int32)
  return jnp.broadcast_to(ids, (batch, ends[-1]))


@pytest.mark.parametrize(
  "b,nq,nk,h,d,mask,run",
  [
    pytest.param(1, 128, 256, 1, 64, False, "aligned", id="aligned_d64_no_mask"),
    pytest.param(2, 51, 300, 1, 64, True, "ragged_mask", id="ragged_mask_two_batch_rows"),
    pytest.param(1, 130, 200, 1, 128, True, "heuristic", id="ragged_d128_two_q_blocks"),
  ],
)
def test_matches_reference(b, nq, nk, h, d, mask, run):
  check(*inputs(b, nq, nk, h, d, mask=mask, seed=nq), config=RUN_CONFIGS[run])


def test_key_blocks_past_a_query_blocks_segments_are_skipped():
  """Two segments of 128 tokens: the first query block (128 rows) sees only
  the first two 64-key blocks, so NaN values in the second segment cannot
  reach it (a visited block would give 0 * NaN in the P V product)."""
  q, k, v, _ = inputs(1, 256, 256, 1, 64, seed=17)
  ids = segments(1, [128, 256])
  v_nan = v.at[:, 128:].set(jnp.nan)
  o, _ = fa.flash_attention_forward(
    q, k, v_nan, segment_ids=ids, config=fa.MosaicAttentionConfig(block_k=64), interpret=True
  )
  want = attention_reference(q, k, v, segment_ids=ids)
  assert_bf16_close(o[:, :128], want[:, :128])


def test_only_prefix_keys_and_empty_prefix():
  q, _, _, _ = inputs(1, 20, 0, 1, 64, seed=15)
  k_prefix, v_prefix, _, _ = inputs(1, 40, 40, 1, 64, seed=16)
  empty = jnp.zeros((1, 0, 1, 64), jnp.bfloat16)
  o, _ = fa.flash_attention_forward(q, empty, empty, k_prefix=k_prefix, v_prefix=v_prefix, interpret=True)
  assert_bf16_close(o, attention_reference(q, k_prefix, v_prefix))
  k, v = k_prefix, v_prefix
  o, _ = fa.flash_attention_forward(q, k, v, k_prefix=empty, v_prefix=empty, interpret=True)
  assert_bf16_close(o, attention_reference(q, k, v))


@pytest.mark.device_stack  # the GPU machine's Mosaic GPU too
def test_lonely_rows_and_hidden_non_finite_keys():
  """Batch row 0 sees no key (no key step at all: output 0, lse +inf); NaN
  and Inf in hidden keys and values reach no output."""
  q, k, v, key_valid = inputs(2, 40, 100, 1, 64, mask=True, seed=3)
  key_valid = key_valid.at[0].set(False)
  hidden = ~key_valid[:, :, None, None]
  k = jnp.where(hidden, jnp.nan, k)
  v = jnp.where(hidden, jnp.inf, v)
  o, lse = fa.flash_attention_forward(q, k, v, key_valid=key_valid, config=RUN_CONFIGS["lonely"], interpret=True)
  np.testing.assert_array_equal(np.asarray(o[0], np.float32), 0.0)
  assert np.isposinf(np.asarray(lse[0])).all()
  assert np.isfinite(np.asarray(o, np.float32)).all()
  clean_k, clean_v = jnp.where(hidden, 0, k), jnp.where(hidden, 0, v)
  assert_bf16_close(o, attention_reference(q, clean_k, clean_v, key_valid=key_valid))


def test_empty_sizes():
  q, k, v, _ = inputs(1, 0, 16, 2, 64)
  o, lse = fa.flash_attention_forward(q, k, v, interpret=True)
  assert o.shape == (1, 0, 2, 64) and lse.shape == (1, 2, 0)
  q, k, v, _ = inputs(1, 5, 0, 2, 64)
  o, lse = fa.flash_attention_forward(q, k, v, interpret=True)
  np.testing.assert_array_equal(np.asarray(o, np.float32), 0.0)
  assert np.isposinf(np.asarray(lse)).all()


@pytest.mark.parametrize(
  "change,match",
  [
    (lambda q, k, v, kv: (q, k[:, :-1], v, kv), "do not match"),
    (lambda q, k, v, kv: (q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), kv), "must be bfloat16"),
    (lambda q, k, v, kv: (q[..., :32], k[..., :32], v[..., :32], kv), "head dim D=32"),
    (lambda q, k, v, kv: (q, k, v, kv[:, :-1]), "key_valid"),
  ],
)
def test_bad_input_is_refused(change, match):
  q, k, v, kv = change(*inputs(1, 8, 16, 1, 64, mask=True))
  with pytest.raises(ValueError, match=match):
    fa.flash_attention_forward(q, k, v, key_valid=kv, interpret=True)


def test_bad_prefix_or_segments_are_refused():
  q, k, v, _ = inputs(1, 8, 16, 1, 64)
  with pytest.raises(ValueError, match="go together"):
    fa.flash_attention_forward(q, k, v, k_prefix=k, interpret=True)
  with pytest.raises(ValueError, match="prefix shapes"):
    fa.flash_attention_forward(q, k, v, k_prefix=k[..., :32], v_prefix=v, interpret=True)
  with pytest.raises(ValueError, match="need Nk == Nq"):
    fa.flash_attention_forward(q, k, v, segment_ids=jnp.zeros((1, 8), jnp.int32), interpret=True)


def test_config_over_shared_memory_is_refused():
  q, k, v, _ = inputs(1, 8, 16, 1, 128)
  with pytest.raises(ValueError, match="shared memory at D=128"):
    fa.flash_attention_forward(q, k, v, config=fa.MosaicAttentionConfig(block_k=128, stages=3), interpret=True)


@pytest.mark.parametrize(
  "b,nq,nk,d", [(4, 2560, 2560, 128), (1, 2352, 1024, 128), (4, 51, 1024, 64), (1, 2352, 51, 64)]
)
def test_every_candidate_lowers_for_h100_at_recorded_sizes(b, nq, nk, d):
  avals = [bf16(b, nq, 32, d), bf16(b, nk, 32, d), bf16(b, nk, 32, d), jax.ShapeDtypeStruct((b, nk), jnp.bool_)]
  for config in fa.candidate_configs({"q": avals[0], "k": avals[1]}):
    fn = lambda q, k, v, kv, c=config: fa.flash_attention_forward(
      q,
      k,
      v,
      key_valid=kv,
      config=c,  # noqa: E731
      interpret=False,
    )
    assert "mosaic_gpu_v2" in lower_for_h100(fn, *avals)


@pytest.mark.parametrize("nq,np_", [(4096, 4125), (6144, 30)])
def test_prefix_cached_lowers_at_recorded_sizes(nq, np_):
  fn = lambda q, k, v, kp, vp: fa.flash_attention_forward(
    q,
    k,
    v,
    k_prefix=kp,
    v_prefix=vp,  # noqa: E731
    interpret=False,
  )
  assert "mosaic_gpu_v2" in lower_for_h100(fn, *[bf16(1, n, 32, 128) for n in (nq, nq, nq, np_, np_)])


@pytest.mark.device_stack  # the GPU machine's Mosaic GPU too
def test_block_causal_lowers_at_recorded_sizes():
  fn = lambda q, k, v, ids: fa.flash_attention_forward(q, k, v, segment_ids=ids, interpret=False)  # noqa: E731
  avals = [bf16(1, 4125, 32, 128)] * 3 + [jax.ShapeDtypeStruct((1, 4125), jnp.int32)]
  assert "mosaic_gpu_v2" in lower_for_h100(fn, *avals)


def launch_with(q, k, v, key_valid, config, fault):
  """The launch with `fault`, as a thunk for `mosaic_faults`."""
  return lambda: fa._forward(
    q, k, v, None, None, key_valid, None, sm_scale=0.125, config=config, interpret=True, fault=fault
  )


@pytest.mark.device_stack  # the GPU machine's Mosaic GPU too
def test_key_slot_released_by_one_consumer_is_caught():
  """`k_empty` counting one arrival instead of one per consumer lets the
  producer refill K before the other consumer read it; the interpreter
  reports the barrier phases running ahead of their waiters. (The race
  detector usually flags the late consumer's read of the key ids against
  the refill first, but not always: which thread gets there first decides;
  not asserted. It cannot see the reads of K and V, wgmma's.)"""
  q, k, v, kv = inputs(1, 128, 512, 1, 64, mask=True, seed=7)
  # 8 steps through 2 slots.
  config = fa.MosaicAttentionConfig(block_k=64, stages=2)
  assert_interpreter_reports(launch_with(q, k, v, kv, config, "release_once"), "phase")


@pytest.mark.device_stack  # the GPU machine's Mosaic GPU too
def test_ping_pong_rendezvous_counted_once_is_caught():
  """`turn` completing a phase on one arrival instead of both consumers'
  lets a consumer's waits run ahead of the rendezvous they belong to; the
  interpreter reports the phase mismatch (no data crosses the rendezvous:
  nothing for the race detector). Without ping-pong the same problem
  matches the reference (every other test runs with it)."""
  q, k, v, kv = inputs(1, 128, 384, 1, 64, mask=True, seed=9)
  config = fa.MosaicAttentionConfig(block_k=64, stages=2)
  assert config.ping_pong
  check(q, k, v, kv, config=fa.MosaicAttentionConfig(block_k=64, stages=2, ping_pong=False))
  assert_interpreter_reports(launch_with(q, k, v, kv, config, "turn_once"), "phase")


@pytest.mark.device_stack  # the GPU machine's Mosaic GPU too
def test_key_ids_released_before_they_are_read_is_caught_by_the_race_detector():
  """A consumer arriving on `k_empty` before it loads the slot's key ids:
  the producer's next TMA into the slot may overwrite them under the read.
  The barrier phases stay in step and the ids are usually read in time, so
  only the race detector catches it, every time: it reports the read
  against that TMA write, whichever of them runs first."""
  q, k, v, kv = inputs(1, 128, 512, 1, 64, mask=True, seed=7)
  config = fa.MosaicAttentionConfig(block_k=64, stages=2)
  assert_race_detected(launch_with(q, k, v, kv, config, "ids_released_early"), fa.__name__)
