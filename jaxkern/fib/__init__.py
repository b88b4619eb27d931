"""FlashInfer-Bench 0.1.2 interop: our datasets and replay results as FIB
TraceSet folders, and FIB TraceSet folders as datasets of ours.

Modules: `formats` (dtype and status mapping, folder layout, solution
names), `definitions` (definitions both ways; matching by math), `bridge`
(our references and kernels on FIB's torch tensors: what exported
`reference` and solution sources call), `export`, `import_` and `cli`
(`python -m jaxkern.fib export|import`). `schemas/` holds FIB 0.1.2's JSON
Schemas (tools/fib/make_schemas.py). The README section "FlashInfer-Bench"
says what is compatible.
"""
