"""`launch/train.py` under the launcher, then, after its CLI `main` returned through the CLIs' exit
(`exit_on_user_error`), one JSON line per rank: the gloo threads left for interpreter shutdown."""
import glob
import json
import os
import sys

from dflash.training.cli import main

main([a for a in sys.argv[1:] if not a.startswith("--local_rank")])  # the launcher adds it
left = [name for name in (open(f).read().strip() for f in glob.glob("/proc/self/task/*/comm")) if "gloo" in name]
sys.stdout.write(json.dumps({"rank_at_exit": int(os.environ["RANK"]), "gloo_threads": sorted(left)}) + "\n")
sys.stdout.flush()
