#!/usr/bin/env python
"""FLOPs of the target feature forward per micro-batch: packed vs real tokens vs padded.

The program is `dflash.tools.count_target_flops` (`python launch/count_target_flops.py --help`).
"""
from dflash.tools.count_target_flops import main

if __name__ == "__main__":
    main()
