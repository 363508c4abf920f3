#!/usr/bin/env python
"""Data preparation at scale: a synthetic set of N conversations tokenized into a token store.

The program is `dflash.tools.bench_prepare` (`python launch/bench_prepare.py --help`).
"""
from dflash.tools.bench_prepare import main

if __name__ == "__main__":
    main()
