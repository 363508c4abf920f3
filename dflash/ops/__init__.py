"""Attention ops on the packed layout; calling convention in dflash/ops/README.md."""
from .common.backend import ATTENTION_BACKENDS
from .dflash_block import dflash_block_attention
from .gated_delta import causal_conv1d_varlen, gated_delta_rule_varlen
from .varlen import varlen_attention

__all__ = ["ATTENTION_BACKENDS", "varlen_attention", "dflash_block_attention", "causal_conv1d_varlen",
           "gated_delta_rule_varlen"]
