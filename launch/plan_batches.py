#!/usr/bin/env python
"""Plan one epoch in every order x layout and show what each costs.

The program is `dflash.tools.plan_batches` (`python launch/plan_batches.py --help`).
"""
from dflash.tools.plan_batches import main

if __name__ == "__main__":
    main()
