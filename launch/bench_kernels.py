#!/usr/bin/env python
"""Benchmark dflash's Triton attention kernels against the public alternatives.

The program is `dflash.tools.bench_kernels` (`python launch/bench_kernels.py --help`).
"""
from dflash.tools.bench_kernels import main

if __name__ == "__main__":
    main()
