"""Pieces every kernel family shares: the `Kernel` type, launching and
lowering helpers, device facts, config validation, the online softmax and
split-KV combine, fp formats and the fp8 MMA primitive."""
