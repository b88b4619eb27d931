"""scripts/gpu_run.sh in its dry mode (CPU, smoke scale, interpret mode):
phase 1 covers every definition, phase 2 resumes its file, phase 3 sweeps
(lowering only here), then the report, the environment and one tarball."""

import json
import os
import pathlib
import subprocess
import sys
import tarfile

import pytest

from jaxkern import registry

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.slow  # a subprocess
def test_dry_run_covers_every_definition_in_phase_1(tmp_path):
  out = tmp_path / "run"
  env = {**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu"}
  p = subprocess.run(["bash", str(REPO / "scripts" / "gpu_run.sh"), str(out)], capture_output=True, text=True,
                     timeout=1500, cwd=tmp_path, env=env)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  log = (out / "run.log").read_text()
  lines = [json.loads(l) for l in (out / "replay.jsonl").read_text().splitlines()]
  names = set(registry.names())
  # Phase 1: one workload of each of the 21 definitions, interleaved.
  phase1 = lines[:len(names)]
  assert {l["definition"] for l in phase1} == names and len(names) == 21
  assert "== phase 1 (one workload per recorded variant): start" in log
  assert "== phase 1 (one workload per recorded variant): end after" in log and "21 results (21 passed" in log
  # Phase 2 resumed phase 1's file and added the second workload of two definitions.
  assert "resume: 21 workloads already in" in log and len(lines) == 23
  assert {l["definition"] for l in lines[21:]} == {"gdn_decode_qk4_v8_d128_k_last",
                                                    "qsa_index_topk_decode_qwen38_h4_d128_topk512_c4"}
  assert len({l["workload"]["uuid"] for l in lines}) == 23
  assert all(l["evaluation"]["status"] == "passed" for l in lines)
  assert all(l["evaluation"]["performance"]["timer"] == "interpret" for l in lines)
  assert all("speed_of_light_ms" in l["evaluation"]["performance"] for l in lines)
  # Phase 3: sweeps (lowering only in the dry run) at the largest recorded axes.
  for name in ("dense_gemm_bf16_nt_n4096_k4096", "moe_router_gemm_topk_deepseek41_d5120_e384_topk6"):
    rows = [json.loads(l) for l in (out / f"sweep_{name}.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["status"] == "lowered" for r in rows)
    assert rows[0]["axes"]["M"] == (24576 if name.startswith("dense") else 4096)
  assert "== phase 3 (sweeps): end after" in log and "2 definitions swept" in log
  assert (out / "report" / "index.html").stat().st_size > 0
  assert "dense_gemm_bf16_nt_n4096_k4096" in (out / "summary.txt").read_text()
  summary = (out / "summary.md").read_text()  # the page docs/perf/<device>.md takes
  assert "dense_gemm_bf16_nt_n4096_k4096" in summary and "interpret" in summary
  env_txt = (out / "env.txt").read_text()
  assert "jax " in env_txt and "git commit:" in env_txt and "nvidia-smi" in env_txt
  with tarfile.open(f"{out}.tar.gz") as tar:
    assert {"run/replay.jsonl", "run/env.txt", "run/run.log", "run/summary.md", "run/report/index.html"} <= set(tar.getnames())
