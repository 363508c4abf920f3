#!/usr/bin/env python
"""Check the memory plan against a real run: a few training steps, measured against the plan.

The program is `dflash.tools.measure_memory` (`python launch/measure_memory.py --help`).
"""
from dflash.tools.measure_memory import main

if __name__ == "__main__":
    main()
