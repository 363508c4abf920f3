"""Train a DFlash drafter against a frozen Hugging Face target with DeepSpeed ZeRO.

  deepspeed [--num_gpus N] launch/train.py [--config FILE.yaml] [options]
  python launch/train.py [options]          # one process on the CPU or the one GPU
  deepspeed --module dflash.training.cli [options]   # the same, from any folder (launch/train.py calls it)

With neither --target nor --data it trains the built-in demo: a tiny drafter against the
bundled demo target on the dataset that target regenerated, on a laptop CPU in minutes.
Defaults otherwise follow the DFlash paper: AdamW lr 6e-4, clip 1.0, cosine with 4% warm-up,
6 epochs, 512 anchors, block 16, gamma 7, 5 draft layers. On a machine without a GPU,
DeepSpeed runs CPU ranks (gloo).

With --target random:qwen3-8b (or random:PATH, the shape of PATH/config.json) the target has random
weights and a synthetic tokenizer, and the data default to `random`: synthetic samples with
seed-like lengths and random token ids, made in memory. Tokens/s are those of the real shapes,
before anything is downloaded (add --time-phases for where the step's time goes).

Examples:
  deepspeed launch/train.py                                   # the CPU demo
  python launch/train.py --target random:qwen3-8b --max-steps 20 --time-phases   # benchmark, no download
  deepspeed --num_gpus 8 launch/train.py --target Qwen/Qwen3-8B-local --data data/store \\
      --token-budget 49152 --order shuffle --layout packed --deepspeed_config ds_configs/zero2.json
"""
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

from dflash.distributed.ranks import peer_failures_are_one_line, single_process_env, stop_with_the_launcher  # noqa: E402
from dflash.errors import exit_on_user_error  # noqa: E402
from dflash.training.checkpoint import Checkpointer  # noqa: E402
from dflash.training.config import load_config  # noqa: E402


@exit_on_user_error
@peer_failures_are_one_line
def main(argv=None):
    config = load_config(argv, description=__doc__)
    # Ctrl-C, SIGTERM, a stopped `deepspeed`: every rank stops, one line; rank 0's says how to continue
    stop_with_the_launcher(Checkpointer(config.run.output_dir, keep=1).resume_hint)
    single_process_env(os.environ, torch.cuda.device_count())  # `python launch/train.py`: one rank, no launcher
    from dflash.training.trainer import Trainer

    result = Trainer(config).train()
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
