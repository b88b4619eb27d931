"""Implementations of the definitions, one module per kernel family.

Each module exports `IMPLS: dict[str, jaxkern.op.OpImpl]` and the reference
functions that the definition files name (`"reference":
"jaxkern.families.<module>:<function>"`). See `jaxkern.op` for the contract.
"""
