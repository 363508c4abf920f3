"""Data side of dflash: raw conversations -> token store -> batch plan -> collated micro-batch.

Public API:
  plan_batches, BatchPlanner, PlannerConfig, ORDERS, LAYOUTS   (dflash.data.planner)
  optimal_buckets, quantile_buckets                            (dflash.data.buckets)
  TokenStore                                                   (dflash.data.token_store)
  prepare_jsonl                                                (dflash.data.prepare)
  collate, PackedBatch, PaddedBatch                            (dflash.data.collate / batch)
  seed_like_lengths                                            (dflash.data.seed_lengths)
Modules that need `datasets` or `transformers` are imported on first use.
"""
from dflash.data.buckets import optimal_buckets, quantile_buckets
from dflash.data.planner import LAYOUTS, ORDERS, BatchPlanner, PlannerConfig, plan_batches
from dflash.data.seed_lengths import seed_like_lengths

_LAZY = {
    "TokenStore": "dflash.data.token_store",
    "prepare_jsonl": "dflash.data.prepare",
    "collate": "dflash.data.collate",
    "PackedBatch": "dflash.data.batch",
    "PaddedBatch": "dflash.data.batch",
}

__all__ = ["plan_batches", "BatchPlanner", "PlannerConfig", "ORDERS", "LAYOUTS", "optimal_buckets",
           "quantile_buckets", "seed_like_lengths", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dflash.data' has no attribute {name!r}")
