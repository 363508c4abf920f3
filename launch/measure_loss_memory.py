#!/usr/bin/env python
"""Peak tensor memory of the chunked drafter loss (forward + backward) on the CPU.

The program is `dflash.tools.measure_loss_memory` (`python launch/measure_loss_memory.py --help`).
"""
from dflash.tools.measure_loss_memory import main

if __name__ == "__main__":
    main()
