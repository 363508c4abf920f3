#!/usr/bin/env python
"""Compare training recipes by the held-out acceptance that decoding measures.

The program is `dflash.tools.compare_recipes` (`python launch/compare_recipes.py --help`).
"""
from dflash.tools.compare_recipes import main

if __name__ == "__main__":
    main()
