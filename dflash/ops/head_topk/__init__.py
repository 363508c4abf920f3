from .interface import HeadStats, head_topk, head_topk_backward_

__all__ = ["HeadStats", "head_topk", "head_topk_backward_"]
