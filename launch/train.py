#!/usr/bin/env python
"""Train a DFlash drafter: `deepspeed [--num_gpus N] launch/train.py [options]` (`--help` for all).

The program is `dflash.training.cli`, so `deepspeed --module dflash.training.cli` does the same
from any folder.
"""
import sys

from dflash.training.cli import main

if __name__ == "__main__":
    main(sys.argv[1:])
