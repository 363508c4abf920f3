#!/usr/bin/env python
"""Plot a training run: loss and acceptance length tau against the step (or the training time).

The program is `dflash.tools.plot_metrics` (`python launch/plot_metrics.py --help`).
"""
import sys

from dflash.tools.plot_metrics import main

if __name__ == "__main__":
    main(sys.argv[1:])
