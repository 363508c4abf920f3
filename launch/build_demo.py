#!/usr/bin/env python
"""Re-create the built-in demo assets: tokenizer, tiny Qwen3 target, prompts, regenerated data.

The program is `dflash.tools.build_demo` (`python launch/build_demo.py --help`).
"""
from dflash.tools.build_demo import main

if __name__ == "__main__":
    main()
