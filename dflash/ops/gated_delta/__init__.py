from .interface import causal_conv1d_varlen, gated_delta_rule_varlen

__all__ = ["causal_conv1d_varlen", "gated_delta_rule_varlen"]
