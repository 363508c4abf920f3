#!/usr/bin/env python
"""Offline compile gate of the Triton kernels: no GPU needed.

The program is `dflash.tools.compile_kernels` (`python launch/compile_kernels.py --help`).
"""
import sys

from dflash.tools.compile_kernels import main

if __name__ == "__main__":
    sys.exit(main())
