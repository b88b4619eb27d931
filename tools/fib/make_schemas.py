"""Writes FlashInfer-Bench 0.1.2's JSON Schemas into jaxkern/fib/schemas/.

Run once, in the venv `make fib-venv` makes (flashinfer-bench 0.1.2 and torch):

    .venv-fib/bin/python tools/fib/make_schemas.py

Each schema is `model_json_schema()` of one of FIB's pydantic models
(flashinfer_bench.data: Definition, Trace, Solution). Pydantic leaves the
models' `model_validator` rules out of a JSON Schema; the two that decide
whether our files load are added by hand below, transliterated from FIB
0.1.2 and marked with a `$comment`:
- `Evaluation._validate_status_correctness_performance`: PASSED carries
  correctness and performance, INCORRECT_NUMERICAL correctness only, every
  other status neither;
- `Definition._validate_reference_code` (the reference is Python source with
  a top-level `run`) cannot be said in JSON Schema: tests/test_fib.py checks
  it with `ast`, as FIB does.
The client itself (`make fib-check`) checks everything, validators included.
"""

import importlib.metadata
import json
import pathlib

from flashinfer_bench import data

VERSION = importlib.metadata.version("flashinfer-bench")
OUT = pathlib.Path(__file__).resolve().parents[2] / "jaxkern" / "fib" / "schemas"

_PRESENT = {"not": {"type": "null"}}


def _status_rules() -> list[dict]:
  def rule(statuses, correctness: bool, performance: bool) -> dict:
    props, required = {}, []
    for name, present in (("correctness", correctness), ("performance", performance)):
      if present:
        required.append(name)
        props[name] = _PRESENT
      else:
        props[name] = {"type": "null"}
    return {
      "if": {"properties": {"status": {"enum": statuses}}, "required": ["status"]},
      "then": {"required": required, "properties": props},
    }

  others = [
    s.value
    for s in data.EvaluationStatus
    if s not in (data.EvaluationStatus.PASSED, data.EvaluationStatus.INCORRECT_NUMERICAL)
  ]
  return [rule(["PASSED"], True, True), rule(["INCORRECT_NUMERICAL"], True, False), rule(others, False, False)]


def main() -> None:
  assert VERSION == "0.1.2", f"these schemas are of flashinfer-bench 0.1.2, this venv has {VERSION}"
  OUT.mkdir(parents=True, exist_ok=True)
  trace = data.Trace.model_json_schema()
  trace["$defs"]["Evaluation"]["allOf"] = _status_rules()
  trace["$defs"]["Evaluation"]["$comment"] = (
    "allOf: Evaluation._validate_status_correctness_performance of flashinfer-bench "
    f"{VERSION}, transliterated by tools/fib/make_schemas.py"
  )
  schemas = {
    "definition": data.Definition.model_json_schema(),
    "trace": trace,
    "solution": data.Solution.model_json_schema(),
  }
  for name, schema in schemas.items():
    schema["$comment"] = (
      f"flashinfer-bench {VERSION} flashinfer_bench.data model_json_schema(); written by tools/fib/make_schemas.py"
    )
    (OUT / f"{name}.schema.json").write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT / f'{name}.schema.json'}")


if __name__ == "__main__":
  main()
