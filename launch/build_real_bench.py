#!/usr/bin/env python
"""Write the real benchmark's prompts (SmolLM2-135M-Instruct as the target).

The program is `dflash.tools.build_real_bench` (`python launch/build_real_bench.py --help`).
"""
from dflash.tools.build_real_bench import main

if __name__ == "__main__":
    main()
