"""The Mosaic GPU flash attention forward
(`pallas_kernels.flash_attention_mosaic_gpu`): interpret-mode runs against the
family's plain-jnp reference (SPEC 5 bf16 rule) and a jnp lse on ragged
sizes, key masks, lonely rows, hidden non-finite keys and values, d64 and
d128 and every candidate; the checks on bad input; the H100 lowering of every
candidate at recorded sizes; and a synchronization fault the interpreter
catches."""

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkern.families.flash_attention import attention_reference
from numerics import assert_bf16_close, assert_f32_close
from pallas_kernels import flash_attention_mosaic_gpu as fa
from pallas_kernels import mosaic_gpu_compat as compat
from pallas_kernels.mosaic_gpu_common import lower_for_h100
from pallas_kernels.online_softmax import LOG2_E


def inputs(b, nq, nk, h, d, *, mask=False, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (b, nq, h, d), jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, nk, h, d), jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, nk, h, d), jnp.bfloat16)
  key_valid = jax.random.bernoulli(ks[3], 0.6, (b, nk)) if mask else None
  return q, k, v, key_valid


def lse_reference(q, k, key_valid):
  """log2 of sum exp(q.k * D**-0.5) over the visible keys, +inf for a row
  that sees none: [B, H, Nq]."""
  s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32),
                 precision=lax.Precision.HIGHEST) * q.shape[-1] ** -0.5
  if key_valid is not None:
    s = jnp.where(key_valid[:, None, None, :], s, -jnp.inf)
  lse = jax.nn.logsumexp(s, axis=-1) * LOG2_E
  return jnp.where(jnp.isneginf(lse), jnp.inf, lse)


def check(q, k, v, key_valid, config=None):
  o, lse = fa.flash_attention_forward(q, k, v, key_valid=key_valid, config=config, interpret=True)
  assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
  assert_bf16_close(o, attention_reference(q, k, v, key_valid=key_valid))
  assert_f32_close(lse, lse_reference(q, k, key_valid))
  return o, lse


@pytest.mark.parametrize("b,nq,nk,h,d,mask", [
    pytest.param(1, 128, 256, 1, 64, False, id="aligned_d64_no_mask"),
    pytest.param(2, 51, 300, 1, 64, True, id="ragged_mask_two_batch_rows"),
    pytest.param(1, 130, 200, 1, 128, True, id="ragged_d128_two_q_blocks"),
])
def test_matches_reference(b, nq, nk, h, d, mask):
  check(*inputs(b, nq, nk, h, d, mask=mask, seed=nq))


def test_lonely_rows_and_hidden_non_finite_keys():
  """Batch row 0 sees no key (output 0, lse +inf); NaN and Inf in hidden
  keys and values reach no output."""
  q, k, v, key_valid = inputs(2, 40, 100, 1, 64, mask=True, seed=3)
  key_valid = key_valid.at[0].set(False)
  hidden = ~key_valid[:, :, None, None]
  k = jnp.where(hidden, jnp.nan, k)
  v = jnp.where(hidden, jnp.inf, v)
  o, lse = fa.flash_attention_forward(q, k, v, key_valid=key_valid, interpret=True)
  np.testing.assert_array_equal(np.asarray(o[0], np.float32), 0.0)
  assert np.isposinf(np.asarray(lse[0])).all()
  assert np.isfinite(np.asarray(o, np.float32)).all()
  clean_k, clean_v = jnp.where(hidden, 0, k), jnp.where(hidden, 0, v)
  assert_bf16_close(o, attention_reference(q, clean_k, clean_v, key_valid=key_valid))


def test_every_candidate_matches_reference():
  q, k, v, key_valid = inputs(1, 64, 130, 1, 64, mask=True, seed=5)
  for config in fa.candidate_configs(64, 130):
    check(q, k, v, key_valid, config)


def test_empty_sizes():
  q, k, v, _ = inputs(1, 0, 16, 2, 64)
  o, lse = fa.flash_attention_forward(q, k, v, interpret=True)
  assert o.shape == (1, 0, 2, 64) and lse.shape == (1, 2, 0)
  q, k, v, _ = inputs(1, 5, 0, 2, 64)
  o, lse = fa.flash_attention_forward(q, k, v, interpret=True)
  np.testing.assert_array_equal(np.asarray(o, np.float32), 0.0)
  assert np.isposinf(np.asarray(lse)).all()


@pytest.mark.parametrize("change,match", [
    (lambda q, k, v, kv: (q, k[:, :-1], v, kv), "do not match"),
    (lambda q, k, v, kv: (q.astype(jnp.float32), k, v, kv), "must be bfloat16"),
    (lambda q, k, v, kv: (q[..., :32], k[..., :32], v[..., :32], kv), "head dim D=32"),
    (lambda q, k, v, kv: (q, k, v, kv[:, :-1]), "key_valid"),
])
def test_bad_input_is_refused(change, match):
  q, k, v, kv = change(*inputs(1, 8, 16, 1, 64, mask=True))
  with pytest.raises(ValueError, match=match):
    fa.flash_attention_forward(q, k, v, key_valid=kv, interpret=True)


def test_config_over_shared_memory_is_refused():
  q, k, v, _ = inputs(1, 8, 16, 1, 128)
  with pytest.raises(ValueError, match="shared memory at D=128"):
    fa.flash_attention_forward(q, k, v, config=fa.MosaicAttentionConfig(block_k=128, stages=3), interpret=True)


@pytest.mark.parametrize("b,nq,nk,d", [(4, 2560, 2560, 128), (1, 2352, 1024, 128), (4, 51, 1024, 64),
                                       (1, 2352, 51, 64)])
def test_every_candidate_lowers_for_h100_at_recorded_sizes(b, nq, nk, d):
  avals = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((b, nq, 32, d), (b, nk, 32, d), (b, nk, 32, d))]
  avals.append(jax.ShapeDtypeStruct((b, nk), jnp.bool_))
  for config in fa.candidate_configs(d, nk):
    fn = jax.jit(lambda q, k, v, kv, c=config: fa.flash_attention_forward(q, k, v, key_valid=kv, config=c,
                                                                          interpret=False))
    assert "mosaic_gpu_v2" in lower_for_h100(fn, *avals)


def test_key_slot_released_by_one_consumer_is_caught():
  """`k_empty` counting one arrival instead of one per consumer lets the
  producer refill K before the other consumer read it; the interpreter
  reports the barrier phases running ahead of their waiters."""
  q, k, v, kv = inputs(1, 128, 512, 1, 64, mask=True, seed=7)
  config = fa.MosaicAttentionConfig(block_k=64, stages=2)   # 8 steps through 2 slots
  try:
    with pytest.raises(Exception, match="phase"):
      jax.block_until_ready(fa._forward(q, k, v, kv, sm_scale=0.125, config=config, interpret=True,
                                        fault="release_once"))
  finally:
    compat.reset_interpreter()
