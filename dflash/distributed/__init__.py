"""Running on many ranks: errors and signals across ranks, the shared run folder, the target
partitioned over the ranks (ZeRO-3)."""
