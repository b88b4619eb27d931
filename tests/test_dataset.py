"""The imported dataset, the typed loader, every validation error and the importer."""

import json
import pathlib
import shutil

import pytest

import jaxkern
from jaxkern import dataset

REPO = pathlib.Path(__file__).resolve().parent.parent
DATASETS = REPO / "datasets"
SEED = REPO.parent / "shared" / "seed" / "workloads.jsonl"

# Recorded counts per definition (the seed's 1104 records).
EXPECTED_COUNTS = {
  "dense_gemm_bf16_nt_n12288_k4096": 31,
  "dense_gemm_bf16_nt_n4096_k12288": 31,
  "dense_gemm_bf16_nt_n4096_k4096": 31,
  "gdn_decode_qk4_v8_d128_k_last": 54,
  "gdn_prefill_qk4_v8_d128_k_last": 100,
  "grouped_gemm_fp8_fp4_e384_n4608_k5120_g32": 52,
  "grouped_gemm_fp8_fp4_e384_n5120_k2304_g32": 52,
  "mixed_mla_decode_deepseek41_h64_d512_k8128_k4512": 42,
  "moe_router_gemm_topk_deepseek41_d5120_e384_topk6": 50,
  "neighborhood_attention_3d_h16_d64_kt3_ky7_kx7": 9,
  "neighborhood_attention_3d_h32_d64_kt3_ky7_kx7": 9,
  "neighborhood_attention_3d_h4_d64_kt11_ky11_kx11": 9,
  "neighborhood_attention_3d_h8_d64_kt3_ky5_kx5": 18,
  "noncausal_dense_attention_h32_d128": 54,
  "noncausal_dense_attention_h32_d64": 108,
  "prefix_cached_block_causal_h32_d128": 28,
  "prefix_cached_block_causal_h32_d128_prefix0": 12,
  "qsa_index_topk_decode_qwen38_h4_d128_topk512_c4": 192,
  "qsa_sparse_gqa_decode_qwen38_h24_kv2_d256_topk512_c4": 192,
  "sparse_mla_prefill_h64_d512_k128": 10,
  "sparse_mla_prefill_h64_d512_k640": 20,
}


@pytest.fixture(scope="module")
def definitions():
  return dataset.load_definitions(DATASETS)


def all_dataset_lines():
  return [l for p in sorted((DATASETS / "workloads").glob("*.jsonl")) for l in p.read_text().splitlines()]


def test_registry_names_are_the_21_definitions(definitions):
  assert jaxkern.registry.names() == sorted(EXPECTED_COUNTS)
  assert sorted(definitions) == sorted(EXPECTED_COUNTS)


def test_definitions_are_fib_compatible(definitions):
  for name, d in definitions.items():
    raw = json.loads((DATASETS / "definitions" / f"{name}.json").read_text())
    assert list(raw)[:4] == ["name", "op_type", "description", "tags"]
    assert d.reference.startswith("jaxkern.families.") and ":" in d.reference
    for spec in [*d.inputs.values(), *d.outputs.values()]:
      assert spec.shape is None or all(a in d.axes for a in spec.shape)
      assert spec.dtype in dataset.DTYPES
    assert d.var_axes, name


def test_load_workloads_round_trip(definitions):
  """Every record loads, typed, with every field exactly as stored."""
  total = 0
  for name, count in EXPECTED_COUNTS.items():
    ws = dataset.load_workloads(name, DATASETS, definitions=definitions)
    assert len(ws) == count, name
    lines = (DATASETS / "workloads" / f"{name}.jsonl").read_text().splitlines()
    for w, line in zip(ws, lines):
      assert w.record == json.loads(line)
      assert w.definition == name and w.uuid == w.record["uuid"] and w.axes == w.record["axes"]
      assert "uuid" not in w.provenance and w.provenance.get("variant") == w.variant
    total += len(ws)
  assert total == 1104


def test_provenance_is_accessible():
  ws = dataset.load_workloads("prefix_cached_block_causal_h32_d128_prefix0")
  segs = [w.provenance["prefix_segments"] for w in ws]
  assert [[0, 8, False], [8, 4104, True], [4104, 4125, False]] in segs
  mla = dataset.load_workloads("sparse_mla_prefill_h64_d512_k640")
  assert {w.record["compression_ratio"] for w in mla} == {1, 2}


@pytest.mark.skipif(not SEED.exists(), reason="the shared seed is not beside this checkout")
def test_seed_import_reproduces_datasets_exactly(tmp_path, definitions):
  counts = dataset.convert(SEED, tmp_path, definitions=definitions)
  assert counts == EXPECTED_COUNTS
  for path in (DATASETS / "workloads").glob("*.jsonl"):
    assert (tmp_path / "workloads" / path.name).read_bytes() == path.read_bytes(), path.name


def test_converter_is_idempotent(tmp_path, definitions):
  """Converting the dataset's own records again gives the same files, byte for byte."""
  src = tmp_path / "all.jsonl"
  src.write_text("".join(l + "\n" for l in all_dataset_lines()))
  dataset.convert(src, tmp_path / "a", definitions=definitions)
  merged = tmp_path / "merged.jsonl"
  merged.write_text("".join(p.read_text() for p in sorted((tmp_path / "a" / "workloads").glob("*.jsonl"))))
  dataset.convert(merged, tmp_path / "b", definitions=definitions)
  for path in (DATASETS / "workloads").glob("*.jsonl"):
    assert (tmp_path / "a" / "workloads" / path.name).read_bytes() == path.read_bytes()
    assert (tmp_path / "b" / "workloads" / path.name).read_bytes() == path.read_bytes()


def test_converter_accepts_fib_traces(tmp_path, definitions):
  trace = {
    "definition": "dense_gemm_bf16_nt_n4096_k4096",
    "workload": {"uuid": "fib-1", "axes": {"M": 7}, "inputs": {"A": {"type": "random"}, "B": {"type": "random"}}},
    "solution": None,
    "evaluation": None,
  }
  src = tmp_path / "traces.jsonl"
  src.write_text(json.dumps(trace) + "\n")
  assert dataset.convert(src, tmp_path / "out", definitions=definitions) == {"dense_gemm_bf16_nt_n4096_k4096": 1}
  (w,) = dataset.load_workloads("dense_gemm_bf16_nt_n4096_k4096", tmp_path / "out", definitions=definitions)
  assert w.uuid == "fib-1" and w.axes == {"M": 7} and w.record["inputs"]["A"] == {"type": "random"}


GOOD = {"uuid": "u-1", "definition": "dense_gemm_bf16_nt_n4096_k4096", "axes": {"M": 12}, "variant": "x"}

BAD_RECORDS = [
  # record or raw line, field named in the error, words in the message
  ("{not json", None, "invalid JSON"),
  ("[1, 2]", None, "JSON object"),
  ({k: v for k, v in GOOD.items() if k != "uuid"}, "uuid", "missing field"),
  ({**GOOD, "uuid": ""}, "uuid", "bad uuid"),
  ({k: v for k, v in GOOD.items() if k != "axes"}, "axes", "missing field"),
  ({**GOOD, "definition": "dense_gemm_bf16_nt_n4096_k4095"}, "definition", "did you mean"),
  ({**GOOD, "axes": {}}, "axes.M", "missing axis"),
  ({**GOOD, "axes": {"M": 12, "Q": 1}}, "axes.Q", "not in the definition"),
  ({**GOOD, "axes": {"M": 12, "N": 4095}}, "axes.N", "const axis disagrees"),
  ({**GOOD, "axes": {"M": 1.5}}, "axes.M", "non-negative integer"),
  ({**GOOD, "axes": {"M": -3}}, "axes.M", "non-negative integer"),
  ({**GOOD, "axes": {"M": True}}, "axes.M", "non-negative integer"),
  ({**GOOD, "axes": {"M": "12"}}, "axes.M", "non-negative integer"),
  ({**GOOD, "axes": []}, "axes", "must be an object"),
]


@pytest.mark.parametrize("bad,field,words", BAD_RECORDS)
def test_each_bad_record_gives_one_clear_error_and_the_rest_loads(tmp_path, definitions, bad, field, words):
  path = tmp_path / "dense_gemm_bf16_nt_n4096_k4096.jsonl"
  good2 = {**GOOD, "uuid": "u-2"}
  bad_line = bad if isinstance(bad, str) else json.dumps(bad)
  path.write_text(json.dumps(GOOD) + "\n" + bad_line + "\n" + json.dumps(good2) + "\n")
  errors = []
  ws = list(dataset.iter_jsonl(path, definitions, on_error=errors.append))
  assert [w.uuid for w in ws] == ["u-1", "u-2"]
  (e,) = errors
  assert e.line == 2 and e.file == str(path) and e.field == field
  text = str(e)
  assert text.startswith(f"{path}:2:") and words in text
  with pytest.raises(dataset.DatasetError):
    list(dataset.iter_jsonl(path, definitions))


def test_constraint_violation_names_the_constraint(definitions):
  rec = {
    "uuid": "g",
    "definition": "gdn_prefill_qk4_v8_d128_k_last",
    "axes": {"total_seq_len": 8, "num_seqs": 2, "len_cu_seqlens": 4},
  }
  with pytest.raises(dataset.DatasetError, match=r"len_cu_seqlens == num_seqs \+ 1"):
    dataset.validate_record(rec, definitions, file="f.jsonl", line=9)


@pytest.mark.parametrize(
  "expr",
  [
    "__import__('os').system('true')",
    "().__class__.__bases__[0].__subclasses__()",
    "M.real > 0",
    "(lambda: 1)()",
    "[M][0] > 0",
    "M if M else N",
    "'a' < 'b'",
    "M ** 99999 > 0",
    "1.5 < M",
    "True",
    "M >",
    "{M} == {M}",
  ],
)
def test_hostile_constraints_are_rejected_not_run(tmp_path, expr):
  ddir = tmp_path / "definitions"
  ddir.mkdir()
  raw = json.loads((DATASETS / "definitions" / "dense_gemm_bf16_nt_n4096_k4096.json").read_text())
  (ddir / "dense_gemm_bf16_nt_n4096_k4096.json").write_text(json.dumps({**raw, "constraints": [expr]}))
  with pytest.raises(dataset.DatasetError, match="bad constraint") as e:
    dataset.load_definitions(tmp_path)
  assert e.value.field == "constraints" and "dense_gemm_bf16_nt_n4096_k4096.json" in str(e.value)


def test_constraint_language():
  axes = {"M": 6, "N": 4, "K": 3}
  for expr, want in [
    ("M >= N and not N > M", True),
    ("M // N * N + M % N == M", True),
    ("0 < N < M < 5", False),
    ("M - N == 2 or K == 0", True),
    ("-M + N < 0", True),
    ("M % (N - 4) == 0", False),
  ]:
    assert dataset.constraint_holds(expr, axes) is want, expr


def test_duplicate_uuid_and_misfiled_record(tmp_path, definitions):
  path = tmp_path / "dense_gemm_bf16_nt_n4096_k4096.jsonl"
  other = {**GOOD, "uuid": "u-3", "definition": "dense_gemm_bf16_nt_n4096_k12288"}
  path.write_text("\n".join(json.dumps(r) for r in (GOOD, GOOD, other)) + "\n")
  errors = []
  ws = list(
    dataset.iter_jsonl(path, definitions, on_error=errors.append, expect_definition="dense_gemm_bf16_nt_n4096_k4096")
  )
  assert len(ws) == 1
  assert [(e.line, e.field) for e in errors] == [(2, "uuid"), (3, "definition")]
  assert "duplicate uuid" in str(errors[0]) and "another definition" in str(errors[1])


def test_bad_definition_files_are_reported(tmp_path):
  ddir = tmp_path / "definitions"
  ddir.mkdir()
  raw = json.loads((DATASETS / "definitions" / "dense_gemm_bf16_nt_n4096_k4096.json").read_text())
  cases = [
    ({**raw, "name": "other"}, "name"),
    ({**raw, "inputs": {"A": {"shape": ["M", "Z"], "dtype": "bfloat16"}}}, "inputs.A.shape"),
    ({**raw, "outputs": {"C": {"shape": ["M", "N"], "dtype": "float64"}}}, "outputs.C.dtype"),
    ({**raw, "axes": {**raw["axes"], "N": {"type": "const"}}}, "axes.N.value"),
    ({**raw, "constraints": ["Z > 1"]}, "constraints"),
  ]
  for bad, field in cases:
    (ddir / "dense_gemm_bf16_nt_n4096_k4096.json").write_text(json.dumps(bad))
    with pytest.raises(dataset.DatasetError) as e:
      dataset.load_definitions(tmp_path)
    assert e.value.field == field


def test_cli_validate_and_stats(tmp_path, capsys):
  assert dataset.main(["validate"]) == 0
  assert "1104 valid records in 21 definitions, 0 errors" in capsys.readouterr().out
  assert dataset.main(["stats"]) == 0
  out = capsys.readouterr().out
  assert "noncausal_dense_attention_h32_d64" in out and "audio_attn2:27" in out and "M=4096..24576" in out
  # A corrupted copy: the bad line is reported, the rest still counts.
  shutil.copytree(DATASETS, tmp_path / "ds")
  path = tmp_path / "ds" / "workloads" / "prefix_cached_block_causal_h32_d128_prefix0.jsonl"
  lines = path.read_text().splitlines()
  lines[2] = lines[2][:50]
  path.write_text("\n".join(lines) + "\n")
  assert dataset.main(["validate", "--dataset", str(tmp_path / "ds")]) == 1
  captured = capsys.readouterr()
  assert f"{path}:3:" in captured.err and "1103 valid records" in captured.out


def test_cli_convert(tmp_path, capsys):
  src = tmp_path / "in.jsonl"
  src.write_text(json.dumps(GOOD) + "\n{broken\n")
  assert (
    dataset.main(["convert", "--input", str(src), "--output", str(tmp_path / "out"), "--definitions", str(DATASETS)])
    == 1
  )
  captured = capsys.readouterr()
  assert f"{src}:2:" in captured.err and "1 records written, 1 skipped" in captured.out
  out = (tmp_path / "out" / "workloads" / "dense_gemm_bf16_nt_n4096_k4096.jsonl").read_text()
  assert out == json.dumps(GOOD) + "\n"


def test_module_entry_point_and_module_sizes():
  """`python -m jaxkern.dataset` runs the package's CLI; each module of the
  package does one job and stays small."""
  import subprocess
  import sys

  out = subprocess.run(
    [sys.executable, "-m", "jaxkern.dataset", "validate"],
    capture_output=True,
    text=True,
    check=False,
    timeout=120,
    cwd=REPO,
  )
  assert out.returncode == 0 and "1104 valid records in 21 definitions" in out.stdout, out.stderr
  for path in (REPO / "jaxkern" / "dataset").glob("*.py"):
    assert len(path.read_text().splitlines()) <= 450, path.name
