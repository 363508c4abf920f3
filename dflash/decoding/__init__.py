"""The decoding and evaluation room: `speculate` (decoding with the target alone and speculative
decoding), `sampling` (the ratio test at a temperature), `target_cache` (the target's KV cache kept at
the accepted length), `acceptance` (the eval walk: what decoding accepts, from the training forward),
`expected_walk` (the walk at a temperature), `walk_stats` (its sums and figures)."""
