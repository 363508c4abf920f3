#!/usr/bin/env python
"""Will a training run fit? The memory plan per rank, before anything loads.

The program is `dflash.tools.plan_memory` (`python launch/plan_memory.py --help`).
"""
from dflash.tools.plan_memory import main

if __name__ == "__main__":
    main()
