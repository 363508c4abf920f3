"""Attention ops on the packed layout; calling convention in dflash/ops/README.md."""
from .dflash_block import dflash_block_attention
from .varlen import varlen_attention

__all__ = ["varlen_attention", "dflash_block_attention"]
