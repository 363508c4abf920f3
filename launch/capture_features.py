#!/usr/bin/env python
"""Capture the target's tapped features of a data set once, for many training runs.

The program is `dflash.tools.capture_features` (`python launch/capture_features.py --help`).
"""
from dflash.tools.capture_features import main

if __name__ == "__main__":
    main()
