"""Implementations of the definitions, one module per kernel family.

Each module `<name>` (kernel: `pallas_kernels.<name>`) exports `IMPLS`, a
tuple of `jaxkern.family.OpImpl`, the reference functions that the
definition files name (`"reference": "jaxkern.families.<name>:<function>"`),
its roofline cost formulas and its public op functions (re-exported by
`jaxkern.ops`). See `jaxkern.family` for the contract.
"""
