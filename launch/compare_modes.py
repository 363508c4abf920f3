#!/usr/bin/env python
"""Compare every batch order x layout on the same target, data and token budget.

The program is `dflash.tools.compare_modes` (`python launch/compare_modes.py --help`).
"""
from dflash.tools.compare_modes import main

if __name__ == "__main__":
    main()
