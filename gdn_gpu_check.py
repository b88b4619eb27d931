"""One-shot GPU check of the GDN kernels (not part of the library): accuracy
against the fp32 references at recorded sizes, timings, config sweep."""
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.getcwd())
from jaxkern.families import gdn as fam  # noqa: E402
from pallas_kernels import gdn as K  # noqa: E402

print(jax.__version__, jax.devices(), flush=True)
CONST = dict(num_q_heads=4, num_k_heads=4, num_v_heads=8, head_size=128)


def bench(f, *args, iters=20):
  out = f(*args)
  jax.block_until_ready(out)
  ts = []
  for _ in range(iters):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append(time.perf_counter() - t)
  return out, float(np.median(ts)) * 1e6


def out_err(o, r):
  x, y = np.asarray(o, np.float32), np.asarray(r, np.float32)
  d = np.abs(x - y)
  return f"out maxabs {d.max():.2e} |ref|max {np.abs(y).max():.3f} bf16fails {int(((d > .005) & (d > .016 * np.abs(y))).sum())}"


def state_err(s, r):
  e, r = np.asarray(s, np.float64) - np.asarray(r, np.float64), np.asarray(r, np.float64)
  rms = np.sqrt((e ** 2).mean() / max((r ** 2).mean(), 1e-30))
  rmax = np.abs(e).max() / max(np.abs(r).max(), 1e-30)
  head = np.sqrt((e ** 2).mean(axis=(2, 3)) / np.maximum((r ** 2).mean(axis=(2, 3)), 1e-30))
  return f"state relrms {rms:.2e} relmax {rmax:.2e} worsthead {head.max():.2e}"


def prefill(total, n, sweep=False, lengths=None):
  axes = dict(total_seq_len=total, num_seqs=n, len_cu_seqlens=n + 1, **CONST)
  x = fam.make_prefill_inputs(axes, jax.random.key(total * 131 + n))
  if lengths is not None:
    x["cu_seqlens"] = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
  args = list(x.values())
  (ro, rs), tr = bench(jax.jit(fam.gdn_prefill_reference), *args, iters=3)
  configs = K.prefill_candidate_configs({k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in x.items()})
  for c in configs if sweep else configs[:1]:
    (o, s), tk = bench(jax.jit(lambda *a, c=c: K.gdn_prefill(*a, config=c)), *args)
    print(f"prefill T={total} N={n} {c}: kernel {tk:.1f}us ref {tr:.0f}us | {out_err(o, ro)} | {state_err(s, rs)}",
          flush=True)


def decode(batch, sweep=False):
  axes = dict(batch_size=batch, seq_len=1, **CONST)
  x = fam.make_decode_inputs(axes, jax.random.key(batch))
  args = list(x.values())
  (ro, rs), tr = bench(jax.jit(fam.gdn_decode_reference), *args)
  configs = K.decode_candidate_configs({k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in x.items()})
  for c in configs if sweep else configs[:1]:
    (o, s), tk = bench(jax.jit(lambda *a, c=c: K.gdn_decode(*a, config=c)), *args)
    d = np.abs(np.asarray(s) - np.asarray(rs))
    print(f"decode B={batch} {c}: kernel {tk:.1f}us ref {tr:.1f}us | {out_err(o, ro)} | state maxabs {d.max():.2e}",
          flush=True)


if sys.argv[1:] == ["ptx"]:  # heuristic configs only, for the ptxas report
  decode(64)
  prefill(8192, 57)
  sys.exit(0)
decode(64, sweep=True)
decode(1, sweep=True)
decode(16)
prefill(8192, 57, sweep=True)
prefill(8192, 1, sweep=True)
prefill(8192, 20)
prefill(5709, 2)
prefill(2107, 1)
prefill(6, 1)
prefill(64 * 64, 64)
prefill(1 + 63 + 64 + 65 + 100, 6, lengths=[1, 63, 0, 64, 65, 100])
