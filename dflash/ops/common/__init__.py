"""Helpers shared by the attention ops: backend choice, input checks, tile lists."""
