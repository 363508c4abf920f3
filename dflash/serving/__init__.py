"""Serving a trained drafter in an inference engine: `vllm` (the drafter with its target in vLLM's
offline engine, its spec-decode metrics beside `dflash.decoding.speculate`'s) and `requirements` (what
`launch/install.sh serve` installs for it)."""
