#!/usr/bin/env python
"""Regeneration throughput over batch sizes, on a fixed prompt subset.

The program is `dflash.tools.bench_regenerate` (`python launch/bench_regenerate.py --help`).
"""
from dflash.tools.bench_regenerate import main

if __name__ == "__main__":
    main()
