"""scripts/gpu_run.sh in its dry mode (CPU, smoke scale, two definitions):
every phase runs and writes its files under one folder, plus a tarball."""

import json
import os
import pathlib
import subprocess
import sys
import tarfile

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.slow  # a subprocess
def test_dry_run_writes_every_phase(tmp_path):
  out = tmp_path / "run"
  env = {**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu",
         "GPU_RUN_DEFINITIONS": "dense_gemm_bf16_nt_n4096_k4096,moe_router", "GPU_RUN_BUDGET_S": "1200"}
  p = subprocess.run(["bash", str(REPO / "scripts" / "gpu_run.sh"), str(out)], capture_output=True, text=True,
                     timeout=1500, cwd=tmp_path, env=env)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  lines = [json.loads(l) for l in (out / "replay.jsonl").read_text().splitlines()]
  assert {l["definition"] for l in lines} == {"dense_gemm_bf16_nt_n4096_k4096",
                                              "moe_router_gemm_topk_deepseek41_d5120_e384_topk6"}
  assert all(l["evaluation"]["status"] == "passed" for l in lines)
  assert all("speed_of_light_ms" in l["evaluation"]["performance"] for l in lines)
  for name in ("dense_gemm_bf16_nt_n4096_k4096", "moe_router_gemm_topk_deepseek41_d5120_e384_topk6"):
    rows = [json.loads(l) for l in (out / f"sweep_{name}.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["status"] == "lowered" for r in rows)
    assert rows[0]["axes"]["M"] == (24576 if name.startswith("dense") else 4096)  # the largest recorded
  assert (out / "report" / "index.html").stat().st_size > 0
  assert "dense_gemm_bf16_nt_n4096_k4096" in (out / "summary.txt").read_text()
  with tarfile.open(f"{out}.tar.gz") as tar:
    assert "run/replay.jsonl" in tar.getnames()
