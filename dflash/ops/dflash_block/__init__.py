from .interface import dflash_block_attention

__all__ = ["dflash_block_attention"]
