"""Gated delta net prefill over packed sequences (SPEC 4.8):
`gdn_prefill_qk4_v8_d128_k_last`. Math, gates and token synthesis:
`jaxkern.families.gdn_decode`. Sequence n covers tokens cu_seqlens[n] ..
cu_seqlens[n+1]-1 from state[n]; a sequence with no tokens gets a zero
new_state row. Kernel: `pallas_kernels.gdn_prefill`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkern import compare, dispatch, roofline
from jaxkern.contract import Checks, public_op
from jaxkern.families.gdn_decode import (
  check_gdn,
  delta_step,
  gates,
  gdn_flops,
  gdn_inputs,
  per_v_head,
  resolve_scale,
)
from jaxkern.family import OpImpl, Precondition, varying_like
from jaxkern.spmd import CONTRACTION, Split
from pallas_kernels.gdn_prefill import KERNELS

_CPU_TOKENS = 192  # prefill tokens at CPU scale (plus total % 64: ragged chunks stay)
_CPU_SEQS = 4


def gdn_prefill_reference(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale):
  """The sequential recurrence over the packed tokens: token t advances the
  state of the sequence covering it. Bounds outside the contract
  (`gdn_prefill`) are first clamped to [0, T], then raised to a running
  maximum (`clamped_cu_seqlens`); a token of no sequence outputs 0, a
  sequence of no tokens gets a zero new_state row.

  A scan of static length, so reverse mode works (`jax.grad` under `jit`),
  with bounded memory: tokens go in blocks of `remat_block(T, N)`, each block
  recomputed in the backward pass (`jax.checkpoint`), which then keeps one
  [N, HV, V, K] state per block and one [HV, V, K] head state per token of
  one block: about 2 sqrt(T N) head states (0.7 GiB at T=8192, N=57) instead
  of T."""
  total = q.shape[0]
  num_seqs, hv, d = state.shape[0], state.shape[1], state.shape[-1]
  if total == 0 or num_seqs == 0:  # No tokens, or no sequence to cover them.
    return jnp.zeros(v.shape, jnp.bfloat16), jnp.zeros(state.shape, jnp.float32)
  cu = clamped_cu_seqlens(cu_seqlens, total)
  token = jnp.arange(total)
  seq = jnp.minimum(jnp.searchsorted(cu[1:], token, side="right"), num_seqs - 1).astype(jnp.int32)
  live = (token >= cu[0]) & (token < cu[-1])
  # Tokens of no sequence enter as zeros: their values (NaN included) then
  # reach neither the forward nor, through where's zero branch, a gradient.
  dead = lambda x: jnp.where(live.reshape(-1, *(1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))  # noqa: E731
  q, k, v, a, b = map(dead, (q, k, v, a, b))
  g, beta = gates(a, b, A_log, dt_bias)  # [T, HV]
  scale = resolve_scale(scale, d)

  def token_step(s, x):
    n, on, qt, kt, vt, gt, bt = x
    s_n = s[n]  # [HV, V, K]
    s_next, o = delta_step(s_n, per_v_head(qt, hv), per_v_head(kt, hv), vt.astype(jnp.float32), gt, bt, scale)
    return s.at[n].set(jnp.where(on, s_next, s_n)), jnp.where(on, o, 0.0)

  @jax.checkpoint
  def block_step(s, xs):
    return lax.scan(token_step, s, xs)

  block = remat_block(total, num_seqs)
  blocks = -(-total // block)
  pad = blocks * block - total  # padding tokens are live nowhere

  def in_blocks(x):
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape(blocks, block, *x.shape[1:])

  xs = tuple(in_blocks(x) for x in (seq, live, q, k, v, g, beta))
  init = varying_like(state.astype(jnp.float32), q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, scale)
  s, out = lax.scan(block_step, init, xs)
  lengths = cu[1:] - cu[:-1]
  s = jnp.where((lengths > 0)[:, None, None, None], s, 0.0)
  return out.reshape(blocks * block, hv, d)[:total].astype(jnp.bfloat16), s


def clamped_cu_seqlens(cu_seqlens: jax.Array, total: int) -> jax.Array:
  """int32 sequence bounds inside the contract: each clamped to [0, total],
  then the running maximum, so that a sequence ending before it starts is
  empty and no token belongs to two sequences (the kernel's rule too:
  `pallas_kernels.gdn_prefill.chunks.normalize_cu_seqlens`)."""
  return lax.cummax(jnp.clip(cu_seqlens.astype(jnp.int32), 0, total))


def remat_block(total: int, num_seqs: int) -> int:
  """Tokens per recomputed block of the reference's scan: sqrt(T N)
  balances the per-block states (T / block of N head states each) against
  one block's per-token head states."""
  return max(1, min(total, math.isqrt(total * max(num_seqs, 1))))


def preconditions(inputs: Mapping[str, jax.Array]) -> list[Precondition]:
  """Checked mode: 0 = cu_seqlens[0] <= ... <= cu_seqlens[N] = T."""
  cu, total = inputs["cu_seqlens"].astype(jnp.int32), inputs["q"].shape[0]
  i = jnp.arange(cu.shape[0])
  previous = jnp.concatenate([cu[:1], cu[:-1]])
  valid = (cu >= 0) & (cu <= total) & (cu >= previous) & ((i > 0) | (cu == 0)) & ((i < cu.shape[0] - 1) | (cu == total))
  return [
    Precondition(
      "cu_seqlens", valid, f"0 = cu_seqlens[0] <= cu_seqlens[1] <= ... <= cu_seqlens[N] = T with T = {total} (tokens)"
    )
  ]


def split_lengths(total: int, num_seqs: int, seed: int) -> np.ndarray:
  """A random composition of `total` tokens into `num_seqs` sequences:
  uniform over compositions with every part >= 1 when total >= num_seqs;
  otherwise `total` sequences of one token and the rest empty, at random
  positions (empty sequences only where the axes force them)."""
  rng = np.random.default_rng(seed)
  if num_seqs == 0:
    return np.zeros(0, np.int64)
  if total >= num_seqs:
    cuts = np.sort(rng.choice(np.arange(1, total), size=num_seqs - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [total]]))
  lengths = np.zeros(num_seqs, np.int64)
  lengths[rng.choice(num_seqs, size=total, replace=False)] = 1
  return lengths


def make_prefill_inputs(axes: Mapping[str, int], key: jax.Array, record: dict | None = None):
  """As the decode inputs, over `total_seq_len` packed tokens; the sequence
  lengths are a random split of total_seq_len into num_seqs (`split_lengths`).
  The contest records carry no per-sequence lengths, so `record` adds no
  structure and sizes come from `axes` (also in a CPU-scaled run)."""
  del record
  total, num_seqs = int(axes["total_seq_len"]), int(axes["num_seqs"])
  hq, hv, d = (int(axes[n]) for n in ("num_q_heads", "num_v_heads", "head_size"))
  k_tok, k_head, k_state, k_split = jax.random.split(key, 4)
  inputs = gdn_inputs((k_tok, k_head, k_state), (total,), num_seqs, hq, hv, d)
  seed = int(jax.random.randint(k_split, (), 0, np.iinfo(np.int32).max))
  lengths = split_lengths(total, num_seqs, seed)
  cu_seqlens = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
  return {**inputs, "cu_seqlens": cu_seqlens, "scale": jnp.zeros((), jnp.float32)}


def prefill_cpu_axes(axes: Mapping[str, int]) -> dict[str, int]:
  """total_seq_len capped at 192 + total % 64 and num_seqs at 4 (still
  several sequences, partial chunks, and no forced empty sequences where the
  recorded axes had none)."""
  out = dict(axes)
  total, num_seqs = int(axes["total_seq_len"]), int(axes["num_seqs"])
  new_total = min(total, _CPU_TOKENS + total % 64)
  new_seqs = min(num_seqs, _CPU_SEQS)
  if total >= num_seqs:
    new_seqs = min(new_seqs, new_total)
  out["total_seq_len"], out["num_seqs"], out["len_cu_seqlens"] = new_total, new_seqs, new_seqs + 1
  return out


# ---------------------------------------------------------------------------
# Roofline cost (`OpImpl.cost`, see `jaxkern.roofline`).


def gdn_prefill_cost(definition, axes, *, inputs=None, record=None, config=None):
  """Gated delta rule over total_seq_len tokens: FLOPs 7 T HV K V, the
  sequential recurrence's work (a chunked kernel does somewhat more), on the
  BF16 peak (the chunked form runs on tensor cores). Bytes: all inputs
  (q, k, v, gates, cu_seqlens, the f32 initial state [N,HV,K,V]) read and
  output and new_state written once."""
  return roofline.Work(gdn_flops(axes["total_seq_len"], axes), roofline.io_bytes(definition, axes), "bf16")


# How the op splits across devices (`jaxkern.spmd`): heads (q/k heads with the
# v heads that read them); the tokens of a sequence are a recurrence and
# cu_seqlens indexes them globally.
_PACKED = "cu_seqlens indexes the packed tokens of every sequence (the tokens of one form a recurrence)"
SPLIT = Split(
  inputs={
    "q": "t h dk",
    "k": "t h dk",
    "v": "t h dv",
    "state": "n h dv dk",
    "A_log": "h",
    "a": "t h",
    "dt_bias": "h",
    "b": "t h",
    "cu_seqlens": "c",
    "scale": "",
  },
  outputs=("t h dv", "n h dv dk"),
  independent="h",
  reasons={
    "t": _PACKED,
    "n": _PACKED,
    "c": _PACKED,
    "dk": CONTRACTION,
    "dv": "the state's rows are updated from all of them",
  },
)
IMPL = OpImpl(
  reference=gdn_prefill_reference,
  kernels=KERNELS,
  make_inputs=make_prefill_inputs,
  cpu_axes=prefill_cpu_axes,
  cost=gdn_prefill_cost,
  policies={"new_state": compare.StateMetric()},
  split=SPLIT,
  preconditions=preconditions,
)
IMPLS = (IMPL,)


# ---------------------------------------------------------------------------
# Public op (`jaxkern.ops`), dispatched by `jaxkern.dispatch`.


def validate(q, k, v, state, A_log, a, dt_bias, b, cu_seqlens, *, sm_scale=None, **_) -> None:
  """The contract of `gdn_prefill` (`jaxkern.contract`): packed tokens, N
  states and cu_seqlens [N + 1] integers."""
  c = Checks("gdn_prefill")
  check_gdn(c, q, k, v, state, A_log, a, dt_bias, b, sm_scale, lead="T", states="N")
  c.shape("cu_seqlens", cu_seqlens, (state.shape[0] + 1,), "[N + 1]", "N from state.shape[0]")
  c.integer("cu_seqlens", cu_seqlens)


@public_op(validate, was_positional=("sm_scale",), renamed={"scale": "sm_scale"})
def gdn_prefill(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  state: jax.Array,
  A_log: jax.Array,
  a: jax.Array,
  dt_bias: jax.Array,
  b: jax.Array,
  cu_seqlens: jax.Array,
  *,
  sm_scale: float | jax.Array | None = None,
  config: Any = None,
  backend: dispatch.Backend = None,
  checks: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Gated delta net over packed sequences (chunked on the Pallas path): q, k [T, HQ, D],
  v [T, HV, D], a, b [T, HV] bf16, A_log, dt_bias [HV] f32, initial k-last states
  [N, HV, V, K] f32, cu_seqlens [N + 1] int32; sm_scale None (or 0) -> D**-0.5. Returns
  (output [T, HV, D] bf16, final states [N, HV, V, K] f32; empty sequences 0).

  Contract:
  * T, N >= 0; HV a multiple of HQ; sequence n covers tokens
    cu_seqlens[n] .. cu_seqlens[n+1]-1, starting from state[n].
  * cu_seqlens int32 [N + 1], valid: 0 = cu_seqlens[0] <= cu_seqlens[1]
    <= ... <= cu_seqlens[N] = T.
  * Outside it (`checks=True` reports the first offending bound), each
    bound is clamped to [0, T] and then raised to the running maximum: a
    sequence that would end before it starts, or past T, is empty or cut
    at T; a token no sequence covers outputs 0; an empty sequence's
    new_state is 0. Tokens outside every sequence never reach an output.
  * Differentiable in q, k, v, the initial states, A_log, a, dt_bias, b and
    sm_scale (Pallas: a chunk-parallel backward).

  Backends: `xla`, `triton`.
  """
  inputs = dict(
    q=q,
    k=k,
    v=v,
    state=state,
    A_log=A_log,
    a=a,
    dt_bias=dt_bias,
    b=b,
    cu_seqlens=cu_seqlens,
    scale=jnp.asarray(0.0 if sm_scale is None else sm_scale, jnp.float32),
  )
  return dispatch.run(IMPL, inputs, config=config, backend=backend, checks=checks)
