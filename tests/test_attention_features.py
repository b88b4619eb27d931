"""The attention features of issue 51 in `jaxkern.ops.attention` and the flash
attention family: causal (bottom-right aligned), grouped-query and
multi-query heads, sliding windows, the logit soft cap, the returned lse and
packed (varlen) sequences.

Every path is checked against a float64 oracle written from the definitions
(a dense masked softmax per sequence, `oracle`): the plain-jnp reference on
the full product of the features (its cheapest path), the Triton forward
and backward in interpret mode on a pairwise covering design (`PAIRWISE`:
each pair of feature levels in some row; ragged and unequal lengths, empty
sequences, rows a band leaves without keys), the Mosaic GPU forward on a
few tiny cases, and the public op on both paths (dispatch, checked mode,
fallback, block skipping, lowering for an H100)."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import gradients
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify
from numerics import assert_bf16_close

import jaxkern
from jaxkern import ops
from jaxkern.families import flash_attention as fam
from pallas_kernels.flash_attention import keys as keys_lib
from pallas_kernels.flash_attention import mosaic_gpu as fa_mosaic
from pallas_kernels.flash_attention import triton as fa
from pallas_kernels.flash_attention.config import FlashAttentionBwdConfig, FlashAttentionConfig, MosaicAttentionConfig
from pallas_kernels.shared.kernel import Unsupported
from pallas_kernels.shared.lowering import lower_for_h100, mosaic_gpu_calls, triton_calls

# Small tiles: several query and key blocks at these sizes.
SMALL = FlashAttentionConfig(block_q=32, block_k=16, num_warps=4, num_stages=2)
SMALL_BWD = FlashAttentionBwdConfig(32, 16, 16, 32, num_warps=4, num_stages=2)
MOSAIC = MosaicAttentionConfig(block_k=64)
HEAD_DIM = 32
HEADS = {"mha": (2, 2), "gqa": (4, 2), "mqa": (4, 1)}  # (H, Hkv)
# None; a two-sided band; left-bounded only (with causal: a causal sliding window).
WINDOWS = {"none": None, "both": (5, 3), "left": (3, None)}
SOFTCAP = 2.0


# ---------------------------------------------------------------------------
# The float64 oracle.


def visible_keys(q_len, kv_len, i, *, causal, window):
  """Keys of a sequence of `kv_len` keys that its query i (of `q_len`) sees:
  aligned bottom-right, query i on key i + kv_len - q_len."""
  aligned = i + kv_len - q_len
  j = np.arange(kv_len)
  left, right = window if window is not None else (None, None)
  seen = np.ones(kv_len, bool)
  if causal:
    seen &= j <= aligned
  if left is not None:
    seen &= j >= aligned - left
  if right is not None:
    seen &= j <= aligned + right
  return seen


def oracle(q, k, v, seqs, *, causal=False, window=None, softcap=None, scale=None, key_valid=None, cotangents=None):
  """Dense masked softmax attention in float64 over packed tokens: q [T, H, D],
  k, v [Tk, Hkv, D], `seqs` the sequences' (query start, query count, key
  start, key count). Returns o [T, H, D] (0 for a row that sees no key and
  for tokens of no sequence) and lse [H, T] (natural log, +inf there); with
  `cotangents` (do like o, dlse like lse) also the gradients (dq, dk, dv)
  of `sum(o * do) + sum(lse * dlse)` over the rows that see a key, by the
  textbook backward (`test_oracle_gradients_match_finite_differences`)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  heads, head_dim = q.shape[1:]
  group = heads // k.shape[1]
  scale = head_dim**-0.5 if scale is None else scale
  o, lse = np.zeros(q.shape), np.full((heads, q.shape[0]), np.inf)
  dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
  for q_start, q_len, k_start, kv_len in seqs:
    rows, cols = slice(q_start, q_start + q_len), slice(k_start, k_start + kv_len)
    seen = np.array([visible_keys(q_len, kv_len, i, causal=causal, window=window) for i in range(q_len)], bool)
    seen = seen.reshape(q_len, kv_len)
    if key_valid is not None:
      seen &= np.asarray(key_valid[cols], bool)[None, :]
    sees = seen.any(1)
    for h in range(heads):
      qh, kh, vh = q[rows, h], k[cols, h // group], v[cols, h // group]
      raw = qh @ kh.T * scale
      s = softcap * np.tanh(raw / softcap) if softcap is not None else raw
      m = np.where(sees, np.max(np.where(seen, s, -np.inf), axis=1, initial=-np.inf), 0.0)
      e = np.where(seen, np.exp(s - m[:, None]), 0.0)
      total = e.sum(1)
      p = e / np.where(sees, total, 1.0)[:, None]
      o[rows, h] = p @ vh
      lse[h, rows] = np.where(sees, m + np.log(np.where(sees, total, 1.0)), np.inf)
      if cotangents is not None:
        do, dlse = np.asarray(cotangents[0], np.float64)[rows, h], np.asarray(cotangents[1], np.float64)[h, rows]
        dv[cols, h // group] += p.T @ do
        ds = p * (do @ vh.T - np.sum(do * o[rows, h], 1, keepdims=True) + np.where(sees, dlse, 0.0)[:, None])
        if softcap is not None:
          ds *= 1.0 - np.tanh(raw / softcap) ** 2
        dq[rows, h] += scale * ds @ kh
        dk[cols, h // group] += scale * ds.T @ qh
  return (o, lse) if cotangents is None else (o, lse, (dq, dk, dv))


def batch_oracle(q, k, v, *, key_valid=None, cotangents=None, **kw):
  """`oracle` of batched q [B, Nq, H, D], k, v [B, Nk, Hkv, D]: o like q,
  lse [B, H, Nq] (cotangents and gradients in the same layouts)."""
  batch, q_len, heads, _ = q.shape
  kv_len = k.shape[1]
  seqs = [(b * q_len, q_len, b * kv_len, kv_len) for b in range(batch)]
  key_valid = None if key_valid is None else np.asarray(key_valid).reshape(-1)
  flat = lambda x: np.asarray(x, np.float64).reshape(-1, *x.shape[2:])  # noqa: E731
  to_heads = lambda lse: lse.reshape(heads, batch, q_len).transpose(1, 0, 2)  # noqa: E731
  if cotangents is not None:
    cotangents = (flat(cotangents[0]), np.asarray(cotangents[1], np.float64).transpose(1, 0, 2).reshape(heads, -1))
  out = oracle(flat(q), flat(k), flat(v), seqs, key_valid=key_valid, cotangents=cotangents, **kw)
  o, lse = out[0].reshape(q.shape), to_heads(out[1])
  if cotangents is None:
    return o, lse
  return o, lse, tuple(g.reshape(x.shape) for g, x in zip(out[2], (q, k, v)))


def cu_seqlens(lengths):
  return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)


def packed_seqs(q_lengths, kv_lengths):
  cq, ck = np.asarray(cu_seqlens(q_lengths)), np.asarray(cu_seqlens(kv_lengths))
  return [(cq[s], q_lengths[s], ck[s], kv_lengths[s]) for s in range(len(q_lengths))]


def normal(seed, shape, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), dtype)


def assert_lse_close(got, want, atol=2e-5):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))  # lonely rows: +inf exactly
  finite = np.isfinite(want)
  np.testing.assert_allclose(got[finite], want[finite], rtol=2e-5, atol=atol)


# ---------------------------------------------------------------------------
# Problems: batched or packed inputs with the oracle's answer.


@dataclasses.dataclass(frozen=True)
class Problem:
  """One attention call's inputs: batched (`lengths` None: B=2, Nq, Nk) or
  packed (`lengths`: per-sequence query and key counts)."""

  heads: str = "mha"
  window: str = "none"
  causal: bool = False
  softcap: bool = False
  lse: bool = False
  packed: bool = False
  q_len: int = 37
  kv_len: int = 50
  q_lengths: tuple[int, ...] = (5, 0, 23, 13)  # a sequence without queries ...
  kv_lengths: tuple[int, ...] = (7, 3, 20, 0)  # ... and one without keys: its queries see nothing
  seed: int = 0
  head_dim: int = HEAD_DIM

  @property
  def features(self) -> dict:
    return dict(causal=self.causal, window=WINDOWS[self.window], softcap=SOFTCAP if self.softcap else None)

  def inputs(self, dtype=jnp.float32):
    heads, kv_heads = HEADS[self.heads]
    if self.packed:
      q_shape, kv_shape = (sum(self.q_lengths), heads, self.head_dim), (sum(self.kv_lengths), kv_heads, self.head_dim)
    else:
      q_shape, kv_shape = (2, self.q_len, heads, self.head_dim), (2, self.kv_len, kv_heads, self.head_dim)
    q, k, v = (normal(self.seed + i, shape, dtype) for i, shape in enumerate((q_shape, kv_shape, kv_shape)))
    return q, k, v

  @property
  def packing(self) -> dict:
    if not self.packed:
      return {}
    return dict(cu_seqlens_q=cu_seqlens(self.q_lengths), cu_seqlens_k=cu_seqlens(self.kv_lengths))

  def expected(self, q, k, v, **extra):
    if self.packed:
      return oracle(q, k, v, packed_seqs(self.q_lengths, self.kv_lengths), **self.features, **extra)
    return batch_oracle(q, k, v, **self.features, **extra)

  def cotangents(self, q):
    """Fixed random cotangents of o and lse, distinct per element (a
    gradient routed to the wrong row, key or head shows)."""
    lse_shape = (q.shape[1], q.shape[0]) if self.packed else (q.shape[0], q.shape[2], q.shape[1])
    return normal(90, q.shape), normal(91, lse_shape)


# The full product of the features, each on or off (the reference's test;
# lse is always returned and checked): a window with both sides bounded
# (with causal: a causal sliding window).
PRODUCT = [
  Problem(heads=h, window=w, causal=c, softcap=s, packed=p, lse=True)
  for h, w, c, s, p in itertools.product(["mha", "gqa"], ["none", "both"], [False, True], [False, True], [False, True])
]

# (heads, window, causal, softcap, lse, packed): every pair of two factors'
# levels in some row (`test_pairwise_design_covers_every_pair`).
PAIRWISE_ROWS = [
  ("mha", "none", False, True, True, True),
  ("mha", "both", False, False, False, False),
  ("mha", "left", True, False, True, True),
  ("gqa", "none", True, True, False, False),
  ("gqa", "both", False, False, False, True),
  ("gqa", "left", False, False, True, True),
  ("mqa", "none", False, False, False, True),
  ("mqa", "both", True, True, True, False),
  ("mqa", "left", True, True, False, False),
]
# Unpacked rows' lengths in turn: Nq < Nk, Nq > Nk (causal leaves the first
# 29 rows of a query block without keys), Nq == Nk; none a block multiple.
BATCH_LENGTHS = [(37, 50), (50, 21), (45, 45)]
PACKED_LENGTHS = [((5, 0, 23, 13), (7, 3, 20, 0)), ((17, 30, 1), (40, 9, 0))]
PAIRWISE = []
for n, (h, w, c, s, lse, p) in enumerate(PAIRWISE_ROWS):
  q_lengths, kv_lengths = PACKED_LENGTHS[n % 2]
  q_len, kv_len = BATCH_LENGTHS[n % 3]
  PAIRWISE.append(Problem(h, w, c, s, lse, p, q_len, kv_len, q_lengths, kv_lengths, seed=n))


def test_pairwise_design_covers_every_pair():
  levels = [list(HEADS), list(WINDOWS), [False, True], [False, True], [False, True], [False, True]]
  for a, b in itertools.combinations(range(len(levels)), 2):
    seen = {(row[a], row[b]) for row in PAIRWISE_ROWS}
    assert seen == set(itertools.product(levels[a], levels[b])), (a, b)


def label(p: Problem) -> str:
  parts = [p.heads, f"window_{p.window}", "causal" * p.causal, "softcap" * p.softcap, "lse" * p.lse]
  return "-".join(x for x in parts + ["packed" if p.packed else f"{p.q_len}x{p.kv_len}"] if x)


# ---------------------------------------------------------------------------
# The reference: every feature combination against the oracle.


@pytest.mark.parametrize("problem", PRODUCT, ids=label)
def test_reference_matches_float64_oracle(problem):
  q, k, v = problem.inputs()
  # Small chunks: several query chunks and an online softmax over key chunks.
  reference = functools.partial(fam.attention_reference, **problem.features, sm_scale=0.3, q_chunk=16, k_chunk=8)
  o, lse = jax.jit(functools.partial(reference, return_lse=True))(q, k, v, **problem.packing)
  want_o, want_lse = problem.expected(q, k, v, scale=0.3)
  np.testing.assert_allclose(np.asarray(o), want_o, atol=2e-5, rtol=1e-4)
  assert_lse_close(lse, want_lse)


def test_reference_without_lse_is_its_output():
  problem = PRODUCT[-1]
  q, k, v = problem.inputs()
  o, _ = fam.attention_reference(q, k, v, **problem.features, **problem.packing, return_lse=True)
  np.testing.assert_array_equal(np.asarray(fam.attention_reference(q, k, v, **problem.features, **problem.packing)), o)


def test_reference_key_valid_with_a_band():
  q, k, v = Problem().inputs()
  key_valid = np.random.default_rng(5).random((2, 50)) < 0.6
  o, lse = fam.attention_reference(q, k, v, key_valid=jnp.asarray(key_valid), causal=True, return_lse=True, k_chunk=16)
  want_o, want_lse = batch_oracle(q, k, v, causal=True, key_valid=key_valid)
  np.testing.assert_allclose(np.asarray(o), want_o, atol=2e-5, rtol=1e-4)
  assert_lse_close(lse, want_lse)


# ---------------------------------------------------------------------------
# The Triton kernels (interpret mode): forward and gradients, pairwise.


def triton_attention(problem: Problem):
  def f(q, k, v):
    return fa.flash_attention(
      q,
      k,
      v,
      **problem.features,
      **problem.packing,
      return_lse=problem.lse,
      config=SMALL,
      backward_config=SMALL_BWD,
      interpret=True,
    )

  return f


def with_gradients(fn, with_lse: bool):
  """`(outputs, (dq, dk, dv))` of `fn(q, k, v)` for cotangents `do` (and
  `dlse`), one jitted function: the forward that saves its residuals and
  the backward kernels, as training compiles them."""

  def run(q, k, v, do, dlse):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp((do, dlse) if with_lse else do)

  return jax.jit(run)


@pytest.mark.parametrize("problem", PAIRWISE, ids=label)
def test_triton_forward_and_gradients(problem):
  q, k, v = problem.inputs()
  do, dlse = problem.cotangents(q)
  out, grads = with_gradients(triton_attention(problem), problem.lse)(q, k, v, do, dlse)
  used_dlse = dlse if problem.lse else jnp.zeros_like(dlse)
  want_o, want_lse, want_grads = problem.expected(q, k, v, cotangents=(do, used_dlse))
  np.testing.assert_allclose(np.asarray(out[0] if problem.lse else out), want_o, atol=2e-5, rtol=1e-4)
  if problem.lse:
    assert_lse_close(out[1], want_lse)
  for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
    np.testing.assert_allclose(np.asarray(g), w, atol=2e-5 * max(1.0, np.abs(w).max()), rtol=1e-4, err_msg=name)


def test_oracle_gradients_match_finite_differences():
  """The oracle's gradients (every feature at once: a causal window, the soft
  cap, grouped heads, an lse cotangent, packed sequences with one that has
  no keys) against central differences of its own float64 forward."""
  rng = np.random.default_rng(7)
  q, k, v = rng.standard_normal((7, 2, 4)), rng.standard_normal((6, 1, 4)), rng.standard_normal((6, 1, 4))
  do, dlse = rng.standard_normal(q.shape), rng.standard_normal((2, 7))
  seqs = packed_seqs((4, 2, 1), (3, 3, 0))
  features = dict(causal=True, window=(1, None), softcap=1.5, scale=0.7)

  def loss(q, k, v):
    o, lse = oracle(q, k, v, seqs, **features)
    return np.sum(o * do) + np.sum(np.where(np.isinf(lse), 0.0, lse) * dlse)

  _, _, grads = oracle(q, k, v, seqs, cotangents=(do, dlse), **features)
  args, eps = [q, k, v], 1e-6
  for n, g in enumerate(grads):
    want = np.zeros(g.shape)
    for index in np.ndindex(g.shape):
      up, down = [x.copy() for x in args], [x.copy() for x in args]
      up[n][index] += eps
      down[n][index] -= eps
      want[index] = (loss(*up) - loss(*down)) / (2 * eps)
    np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-7)


def test_key_blocks_outside_the_band_are_not_visited():
  """NaN values in keys no row of a query block sees, and whole blocks away
  from it, cannot reach it: the blocks are neither loaded nor computed (a
  visited block would give 0 x NaN in the value product). Causal, Nq = Nk =
  64, 32-row query blocks over 16-key blocks: the first query block sees
  blocks 0 and 1 only; with a window (left 3) the second sees blocks 1-3."""
  q, k, v = Problem(q_len=64, kv_len=64).inputs()
  v_nan = v.at[:, 32:].set(jnp.nan)
  out = fa.flash_attention(q, k, v_nan, causal=True, config=SMALL, interpret=True)
  want, _ = batch_oracle(q, k, v, causal=True)
  np.testing.assert_allclose(np.asarray(out[:, :32]), want[:, :32], atol=2e-5, rtol=1e-4)
  assert np.isnan(np.asarray(out[:, 32:])).all()
  v_nan = v.at[:, :16].set(jnp.nan)
  out = fa.flash_attention(q, k, v_nan, causal=True, window=(3, None), config=SMALL, interpret=True)
  want, _ = batch_oracle(q, k, v, causal=True, window=(3, None))
  np.testing.assert_allclose(np.asarray(out[:, 32:]), want[:, 32:], atol=2e-5, rtol=1e-4)


def test_band_limits_match_brute_force():
  """Per query block the forward's key blocks hold every key a row sees and
  the unmasked ones only keys every row sees; per key block the dK/dV
  walk's query blocks hold every query that sees one of its keys: for
  unpacked windows (from program ids) and packed intervals (tables)."""
  q_len, kv_len, bq, bk = 45, 70, 16, 8
  starts = jnp.arange(0, q_len, bq)
  key_starts = jnp.arange(0, kv_len, bk)
  windows = [keys_lib.Window(None, 0), keys_lib.Window(3, 5), keys_lib.Window(0, None), keys_lib.Window(10, 0)]
  packed = keys_lib.Window(4, 0, packed=True)
  cq, ck = cu_seqlens([10, 0, 30, 5]), cu_seqlens([20, 8, 30, 12])
  for window in [*windows, packed]:
    band = keys_lib.Band(window, q_len, kv_len)
    if window.packed:  # the kernel loads each block's rows (padding rows see nothing), the tables come from XLA
      lo, hi = keys_lib.packed_intervals(cq, ck, window, q_len=q_len, kv_len=kv_len)
      pad = len(starts) * bq - q_len
      blocks = [jnp.pad(x, (0, pad), constant_values=c).reshape(-1, bq) for x, c in ((lo, kv_len), (hi, -1))]
      of = functools.partial(keys_lib.RowBand.of, q_len=q_len, kv_len=kv_len, block_k=bk)
      row_bands = jax.vmap(of)(*blocks, starts)
      query_limits = keys_lib.band_query_block_limits(lo, hi, kv_len=kv_len, block_q=bq, block_k=bk)
    else:
      lo, hi = keys_lib.window_intervals(jnp.arange(q_len), window, q_len=q_len, kv_len=kv_len)
      row_bands = jax.vmap(lambda start, band=band: band.rows(start, bq, bk))(starts)
      query_limits = jnp.stack(jax.vmap(lambda j, band=band: band.query_blocks(j, bk, bq))(key_starts), axis=1)
    limits = np.stack(jax.vmap(lambda r: r.blocks(kv_len // bk, -(-kv_len // bk)))(row_bands), axis=1)
    lo, hi = np.asarray(lo), np.asarray(hi)
    sees = (np.arange(kv_len)[None] >= lo[:, None]) & (np.arange(kv_len)[None] <= hi[:, None])  # [query, key]
    for n, (first, full_first, full_end, end) in enumerate(limits):
      block_rows = sees[n * bq : (n + 1) * bq]
      visible = np.flatnonzero(block_rows.any(0))
      assert visible.size == 0 or (first * bk <= visible[0] and visible[-1] < end * bk), (window, n)
      assert block_rows[:, full_first * bk : full_end * bk].all(), (window, n)
    for j, (first, end) in enumerate(np.asarray(query_limits)):
      queries = np.flatnonzero(sees[:, j * bk : (j + 1) * bk].any(1))
      assert queries.size == 0 or (first * bq <= queries[0] and queries[-1] < end * bq), (window, j)


# ---------------------------------------------------------------------------
# The Mosaic GPU forward (interpret mode: few, tiny cases).


MOSAIC_CASES = [
  # One CTA of 128 rows over 2 key steps; grouped heads, causal with Nq > Nk (20 rows without keys).
  Problem(heads="gqa", causal=True, lse=True, q_len=100, kv_len=80, head_dim=64),
  # Packed: a sequence without queries, one without keys; a two-sided window, the soft cap.
  Problem(
    heads="mqa",
    window="both",
    softcap=True,
    lse=True,
    packed=True,
    q_lengths=(30, 0, 50),
    kv_lengths=(70, 5, 0),
    head_dim=64,
  ),
]


@pytest.mark.parametrize("problem", MOSAIC_CASES, ids=label)
def test_mosaic_gpu_forward(problem):
  q, k, v = problem.inputs(jnp.bfloat16)
  kw = dict(**problem.features, **problem.packing, config=MOSAIC, interpret=True)
  o, lse = fa_mosaic.flash_attention(q, k, v, return_lse=True, **kw)
  want_o, want_lse = problem.expected(q, k, v)
  assert_bf16_close(o, want_o)
  assert_lse_close(lse, want_lse, atol=1e-4)
  base2_o, base2_lse = fa_mosaic.flash_attention_forward(q, k, v, **kw)  # lse in base 2, o the same
  np.testing.assert_array_equal(np.asarray(base2_o, np.float32), np.asarray(o, np.float32))
  assert_lse_close(base2_lse * np.log(2.0), want_lse, atol=1e-4)


def test_mosaic_gpu_forward_with_triton_backward():
  """The Mosaic GPU forward's gradient is the Triton backward's, from its lse."""
  problem = MOSAIC_CASES[0]
  q, k, v = problem.inputs(jnp.bfloat16)
  do, dlse = problem.cotangents(q)

  def mosaic(q, k, v):
    return fa_mosaic.flash_attention(
      q, k, v, **problem.features, return_lse=True, config=MOSAIC, backward_config=SMALL_BWD, interpret=True
    )

  _, grads = with_gradients(mosaic, True)(q, k, v, do.astype(jnp.bfloat16), dlse)
  gradients.assert_grads_close(grads, problem.expected(q, k, v, cotangents=(do, dlse))[2], ("dq", "dk", "dv"))


# ---------------------------------------------------------------------------
# The public op: both paths, checked mode, explain, lowering.


def test_op_paths_agree():
  """`ops.attention` with every feature: the XLA path (the reference, plain
  autodiff) and the Pallas path (Triton first) agree with the oracle,
  outputs and gradients (the lse's too), under jit."""
  problem = Problem(heads="gqa", window="left", causal=True, softcap=True, lse=True, packed=True)
  q, k, v = problem.inputs(jnp.bfloat16)
  do, dlse = problem.cotangents(q)
  want_o, want_lse, want_grads = problem.expected(q, k, v, cotangents=(do, dlse))
  for backend in ("xla", "pallas"):

    def op(q, k, v, backend=backend):
      return ops.attention(q, k, v, **problem.features, **problem.packing, return_lse=True, backend=backend)

    (o, lse), grads = with_gradients(op, True)(q, k, v, do.astype(jnp.bfloat16), dlse)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (4, q.shape[0]) and lse.dtype == jnp.float32
    assert_bf16_close(o, want_o)
    assert_lse_close(lse, want_lse, atol=1e-4)
    gradients.assert_grads_close(grads, want_grads, ("dq", "dk", "dv"))


def test_op_without_features_is_the_recorded_path():
  """No feature: the call runs the non-causal definition's op, as before."""
  q, k, v = Problem(q_len=8, kv_len=8).inputs(jnp.bfloat16)
  assert jaxkern.explain(ops.attention, q, k, v, backend="triton").op == "noncausal_attention"
  assert jaxkern.explain(ops.attention, q, k, v, causal=True, backend="triton").op == "attention"
  grouped = jaxkern.explain(ops.attention, q, k[:, :, :1], v[:, :, :1], backend="pallas")
  assert grouped.backend == "triton" and grouped.op == "attention"


def test_mosaic_gpu_refuses_what_it_does_not_take():
  """f32 inputs and a traced scale: the Mosaic GPU kernel refuses with
  `Unsupported` (so that `pallas` would run Triton)."""
  q, k, v = Problem(q_len=8, kv_len=8, head_dim=64).inputs()
  with pytest.raises(Unsupported, match="bfloat16"):
    ops.attention(q, k, v, causal=True, backend="mosaic_gpu")
  q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
  with pytest.raises(Unsupported, match="sm_scale"):
    jax.jit(lambda s: ops.attention(q, k, v, causal=True, sm_scale=s, backend="mosaic_gpu"))(0.5)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_empty_sizes(backend):
  """No batch row, no token, no key: the shapes, zeros and lse +inf."""
  kw = dict(return_lse=True, backend=backend)
  q = jnp.zeros((0, 8, 2, 64), jnp.bfloat16)
  o, lse = ops.attention(q, q[:, :, :1], q[:, :, :1], causal=True, **kw)
  assert o.shape == (0, 8, 2, 64) and lse.shape == (0, 2, 8)
  none = jnp.zeros((1,), jnp.int32)  # zero sequences
  tokens = jnp.zeros((0, 2, 64), jnp.bfloat16)
  o, lse = ops.attention(tokens, tokens, tokens, cu_seqlens_q=none, cu_seqlens_k=none, **kw)
  assert o.shape == (0, 2, 64) and lse.shape == (2, 0)
  q, k = jnp.ones((5, 2, 64), jnp.bfloat16), jnp.zeros((0, 1, 64), jnp.bfloat16)
  five, empty = jnp.asarray([0, 5], jnp.int32), jnp.asarray([0, 0], jnp.int32)
  o, lse = ops.attention(q, k, k, cu_seqlens_q=five, cu_seqlens_k=empty, causal=True, **kw)
  np.testing.assert_array_equal(np.asarray(o, np.float32), 0.0)
  assert o.shape == q.shape and np.isposinf(np.asarray(lse)).all()


def test_features_inside_shard_map():
  """Causal grouped heads with the lse, split over heads inside
  `jax.shard_map` (its vma checks on), on both paths."""
  mesh = jax.make_mesh((1,), ("x",))
  heads, lse_heads = jax.P(None, None, "x"), jax.P(None, "x", None)
  problem = Problem(heads="gqa", causal=True, q_len=20, kv_len=24, head_dim=64)
  q, k, v = problem.inputs(jnp.bfloat16)
  want_o, want_lse = problem.expected(q, k, v)
  q, k, v = (jax.device_put(x, jax.NamedSharding(mesh, heads)) for x in (q, k, v))
  for backend in ("xla", "pallas"):

    def op(q, k, v, backend=backend):
      return ops.attention(q, k, v, causal=True, return_lse=True, backend=backend)

    o, lse = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=(heads,) * 3, out_specs=(heads, lse_heads)))(q, k, v)
    assert_bf16_close(o, want_o)
    assert_lse_close(lse, want_lse, atol=1e-4)


def test_checked_mode_reports_bad_cu_seqlens():
  q, k, v = Problem(packed=True).inputs(jnp.bfloat16)
  good = cu_seqlens((5, 0, 23, 13))
  bad = good.at[2].set(3)  # decreasing
  f = jaxkern.ops.checked(
    jax.jit(lambda cq: ops.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=cu_seqlens((7, 3, 20, 0)), checks=True))
  )
  f(good)
  with pytest.raises(checkify.JaxRuntimeError, match=r"cu_seqlens_q\[2\] = 3 is outside its valid range"):
    f(bad)
  with pytest.raises(checkify.JaxRuntimeError, match=r"cu_seqlens_k\[4\] = 29 is outside its valid range"):
    ops.attention(q, k, v, cu_seqlens_q=good, cu_seqlens_k=cu_seqlens((7, 3, 19, 0)), checks=True)


def test_invalid_cu_seqlens_give_the_same_answer_on_both_paths():
  """Outside the contract both paths read cu_seqlens by the same rule."""
  q, k, v = Problem(packed=True).inputs(jnp.bfloat16)
  for cq, ck in [([0, 30, 20, 41], [0, 12, 40, 30]), ([3, 10, 10, 50], [-5, 10, 20, 25])]:
    kw = dict(cu_seqlens_q=jnp.asarray(cq, jnp.int32), cu_seqlens_k=jnp.asarray(ck, jnp.int32), causal=True)
    o, lse = ops.attention(q, k, v, return_lse=True, backend="triton", **kw)
    o_xla, lse_xla = ops.attention(q, k, v, return_lse=True, backend="xla", **kw)
    assert_bf16_close(o, o_xla)
    assert_lse_close(lse, lse_xla, atol=1e-4)


def test_features_lower_for_h100():
  """The Triton forward and its backward with every feature, and the Mosaic
  GPU forward with a band, lower for an H100 (their sm_90a compile:
  docs/perf/attention_features.md)."""
  q = jax.ShapeDtypeStruct((2, 300, 8, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 200, 2, 128), jnp.bfloat16)
  features = dict(causal=True, window=(64, None), softcap=30.0)

  def loss(q, k, v):
    o, lse = fa.flash_attention(q, k, v, return_lse=True, interpret=False, **features)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(lse)

  names = sorted(c.name for c in triton_calls(lower_for_h100(jax.grad(loss, (0, 1, 2)), q, kv, kv)))
  assert names == ["flash_attention", "flash_attention_bwd_dkdv", "flash_attention_bwd_dq"]
  packed_q = jax.ShapeDtypeStruct((500, 8, 128), jnp.bfloat16)
  packed_kv = jax.ShapeDtypeStruct((400, 2, 128), jnp.bfloat16)
  cu = jax.ShapeDtypeStruct((4,), jnp.int32)

  def mosaic(q, k, v, cq, ck):
    return fa_mosaic.flash_attention_forward(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, interpret=False, **features)

  assert len(mosaic_gpu_calls(lower_for_h100(mosaic, packed_q, packed_kv, packed_kv, cu, cu))) == 1
