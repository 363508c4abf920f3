#!/usr/bin/env python
"""Tokenize conversations into a dflash token store.

The program is `dflash.tools.prepare_data` (`python launch/prepare_data.py --help`).
"""
from dflash.tools.prepare_data import main

if __name__ == "__main__":
    main()
