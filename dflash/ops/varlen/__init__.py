from .interface import varlen_attention

__all__ = ["varlen_attention"]
