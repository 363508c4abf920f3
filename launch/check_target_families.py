#!/usr/bin/env python
"""Packed target features of every target family against a Hugging Face forward of each sample alone.

The program is `dflash.tools.check_target_families` (`python launch/check_target_families.py --help`).
"""
from dflash.tools.check_target_families import main

if __name__ == "__main__":
    main()
