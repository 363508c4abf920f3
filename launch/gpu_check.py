#!/usr/bin/env python
"""One-shot GPU check of the attention kernels and a training step, made for a lent GPU machine.

The program is `dflash.tools.gpu_check` (`python launch/gpu_check.py --help`).
"""
import sys

from dflash.tools.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
