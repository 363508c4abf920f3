#!/usr/bin/env python
"""Regenerate a conversation dataset with the target model (the data a DFlash drafter learns from).

The program is `dflash.tools.regenerate` (`python launch/regenerate.py --help`).
"""
from dflash.tools.regenerate import main

if __name__ == "__main__":
    main()
