#!/usr/bin/env python
"""Tune a DeepSpeed JSON on the real job: short training trials ranked by real tokens/s.

The program is `dflash.tools.tune_ds_config` (`python launch/tune_ds_config.py --help`).
"""
from dflash.tools.tune_ds_config import main

if __name__ == "__main__":
    main()
