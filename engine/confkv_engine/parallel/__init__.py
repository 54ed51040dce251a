"""Tensor parallelism over ``torch.distributed``: the process group (``group``), weight sharding
at load (``shard``), the step plan rank 0 broadcasts (``plan``), the rank workers (``worker``) and
the launcher that spawns the ranks (``launch``). Degree 1 uses none of it."""
