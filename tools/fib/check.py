"""The real-client check of an exported TraceSet folder (`make fib-check`),
run in the venv that has flashinfer-bench 0.1.2 and torch (`.venv-fib`):

    .venv-fib/bin/python tools/fib/check.py DIR --definitions 21 --workloads 1104 --traces N \
        --reference dense_gemm_bf16_nt_n4096_k4096 --reference moe_router_gemm_topk_deepseek41_d5120_e384_topk6

1. `TraceSet.from_path(DIR)` loads it (FIB's models and validators) with the
   expected numbers of definitions, workload traces and traces;
2. `flashinfer-bench report summary --local DIR` exits 0;
3. for each `--reference` definition, FIB's own reference builder
   (`BuilderRegistry.build_reference`) builds the exported `run`, FIB's input
   generator (`gen_inputs`, on the CPU) makes inputs for the definition's
   smallest workload, and the outputs equal our jnp reference's on the same
   inputs, bit for bit;
4. every exported solution builds with FIB's builder (its `run` imports
   and has the definition's signature).
Prints one line per check; exit 1 on the first failure.
"""

import argparse
import math
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import torch
from flashinfer_bench.bench.utils import gen_inputs
from flashinfer_bench.compile import BuilderRegistry
from flashinfer_bench.data import TraceSet

from jaxkern import registry
from jaxkern.fib import bridge


def check_reference(ts: TraceSet, name: str) -> str:
  definition = ts.definitions[name]
  workload = min(ts.workloads[name], key=lambda t: math.prod(t.workload.axes.values())).workload
  runnable = BuilderRegistry.get_instance().build_reference(definition)
  torch.manual_seed(0)
  inputs = gen_inputs(definition, workload, device="cpu")
  with torch.no_grad():
    got = runnable(*inputs)
  got = got if isinstance(got, tuple) else (got,)
  op = registry.get(name)
  arrays = [
    jnp.asarray(bridge.to_our_array(bridge.torch_to_numpy(x), s)) for x, s in zip(inputs, op.definition.inputs.values())
  ]
  want = op.reference(dict(zip(op.definition.inputs, arrays)))
  for (out_name, w), g in zip(want.items(), got):
    g = bridge.to_our_array(bridge.torch_to_numpy(g), op.definition.outputs[out_name])
    if g.shape != w.shape or not np.array_equal(g.view(np.uint8), np.asarray(w).view(np.uint8)):
      raise AssertionError(f"{name}: output {out_name} of FIB's reference build differs from ours")
  return (
    f"reference builder: {name} at {workload.axes} (uuid {workload.uuid}): outputs "
    f"{[f'{n} {tuple(w.shape)} {w.dtype}' for n, w in want.items()]} equal ours bit for bit"
  )


def main() -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("dir")
  parser.add_argument("--definitions", type=int, required=True)
  parser.add_argument("--workloads", type=int, required=True)
  parser.add_argument("--traces", type=int, required=True)
  parser.add_argument("--reference", action="append", default=[])
  args = parser.parse_args()

  ts = TraceSet.from_path(args.dir)
  n_w = sum(len(v) for v in ts.workloads.values())
  n_t = sum(len(v) for v in ts.traces.values())
  n_s = sum(len(v) for v in ts.solutions.values())
  print(f"TraceSet.from_path: {len(ts.definitions)} definitions, {n_w} workloads, {n_t} traces, {n_s} solutions")
  assert (len(ts.definitions), n_w, n_t) == (args.definitions, args.workloads, args.traces), "unexpected counts"
  print(f"TraceSet.summary(): {ts.summary()}")

  cli = pathlib.Path(sys.executable).with_name("flashinfer-bench")
  run = subprocess.run(
    [str(cli), "report", "summary", "--local", args.dir], capture_output=True, text=True, check=False
  )
  print(f"flashinfer-bench report summary: exit {run.returncode}: {(run.stdout + run.stderr).strip()[-400:]}")
  assert run.returncode == 0, "report summary failed"

  for name in args.reference:
    print(check_reference(ts, name))

  for sols in ts.solutions.values():
    for s in sols:
      BuilderRegistry.get_instance().build(ts.definitions[s.definition], s)
  print(f"solutions: all {n_s} build with FIB's builder")
  print("fib-check: all checks passed")
  return 0


if __name__ == "__main__":
  sys.exit(main())
