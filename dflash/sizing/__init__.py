"""Sizing a run before it loads: the memory plan (bytes per rank, the row budget that fits) and the
FLOP model of the target and the drafter."""
