"""What the tests build again and again, importable (as transformers' `testing_utils`): a tiny Qwen3
target's config, the one-rank process group that the trainer's parts run under in-process, and a
one-rank training run in this process (`train_in_process`: what `launch/train.py` runs on one rank,
less the interpreter's start; a test of the launcher itself, of signals or of several ranks launches)."""
from __future__ import annotations

import contextlib
import os


def tiny_qwen3_config(**sizes):
    """A Qwen3 config of a few layers and a small vocabulary (every size overridable by keyword): a target
    that builds and runs in a fraction of a second on the CPU."""
    from transformers import Qwen3Config

    return Qwen3Config(**{**dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                 max_position_embeddings=512), **sizes})


@contextlib.contextmanager
def launcher_env():
    """The variables the launcher gives a rank of a one-rank run (`single_process_env`), set for the
    block and removed after it (a process started later must not think it runs under a launcher)."""
    from dflash.distributed.ranks import single_process_env

    before = set(os.environ)
    single_process_env(os.environ, num_gpus=0)
    try:
        yield
    finally:
        for name in set(os.environ) - before:
            del os.environ[name]


def _group() -> bool:
    """A one-rank gloo process group in this process, made unless one exists; whether it was made here."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=0,
                            world_size=1)
    import sys

    if "deepspeed" in sys.modules:  # DeepSpeed saw a group that is gone: it starts again from this one
        import deepspeed.comm.comm
        import deepspeed.utils.groups

        deepspeed.comm.comm.cdb = None
        deepspeed.utils.groups._WORLD_GROUP = None
    return True


@contextlib.contextmanager
def one_rank():
    """A one-rank process group for the block, as the trainer has under the launcher: ranks' logic
    without a launch. A group made here is destroyed after the block; an existing one is used and kept."""
    import torch.distributed as dist

    with launcher_env():
        made = _group()
    try:
        yield
    finally:
        if made and dist.is_initialized():
            dist.destroy_process_group()


def train_in_process(argv) -> dict:
    """`launch/train.py argv` on one rank in this process: the options loaded and checked as the script
    loads them, then `Trainer(...).train()`'s result. The process group stays for the process: DeepSpeed
    keeps the world group it saw, and a second run under a new one would fail."""
    from dflash.training.config import load_config
    from dflash.training.trainer import Trainer

    with launcher_env():
        _group()
        return Trainer(load_config([str(a) for a in argv])).train()
