#!/usr/bin/env python
"""Speculative decoding with a trained DFlash drafter: acceptance length, speed, and proof it is lossless.

The program is `dflash.tools.speculate` (`python launch/speculate.py --help`).
"""
from dflash.tools.speculate import main

if __name__ == "__main__":
    main()
