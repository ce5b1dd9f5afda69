"""Data-parallel drop-ins: DistributedDataParallel, fully_shard, distribute, run_spmd."""
