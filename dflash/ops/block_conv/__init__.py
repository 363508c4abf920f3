from .interface import block_conv

__all__ = ["block_conv"]
