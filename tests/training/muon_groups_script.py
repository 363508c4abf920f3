"""Run as one process (world size 1, CPU): the parameter groups DeepSpeed's Muon optimizer holds for a
tiny DFlash2 drafter built by the trainer's `engine_for`. Prints MUON_GROUPS=<json>: for each group,
use_muon and the names of its parameters."""
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from dflash.distributed.process_group import init_distributed  # noqa: E402
from dflash.distributed.ranks import single_process_env  # noqa: E402
from dflash.drafter.network import drafter_class  # noqa: E402
from dflash.models import DrafterConfig  # noqa: E402
from dflash.training.config import load_config  # noqa: E402
from dflash.training.ds_config import load_ds_config, with_optimizer  # noqa: E402
from dflash.training.models import drafter_kind_settings, engine_for  # noqa: E402
from tests.drafter.drafter_helpers import MASK_ID, TAPS, tiny_target  # noqa: E402  (PYTHONPATH: the repository)

single_process_env(os.environ, num_gpus=0)
init_distributed()
torch._dynamo.config.disable = True
target = tiny_target(0)
config = DrafterConfig.from_target(target.config, mask_token_id=MASK_ID, block_size=4, draft_layers=2,
                                   target_layer_ids=TAPS, **drafter_kind_settings("dflash2"))
drafter = drafter_class(config)(config, target.shared_weights())
cfg = load_config(["--data", "d.jsonl", "--optimizer", "muon", "--drafter-kind", "dflash2"])
o = cfg.optim
ds_config = with_optimizer(load_ds_config(f"ds_configs/zero{sys.argv[1]}.json", world_size=1, grad_clip=o.grad_clip,
                                          bf16=False),
                           o.optimizer, lr=o.lr, muon_lr=o.muon_lr, momentum=o.muon_momentum,
                           weight_decay=o.weight_decay, named="test")
engine, optimizer, _ = engine_for(drafter, ds_config, cfg.optim, 10, "cpu")
names = {id(p): n for n, p in drafter.named_parameters()}
inner = optimizer.optimizer  # ZeRO's wrapper around DeepSpeed's MuonWithAuxAdam
# ZeRO hands the inner optimizer flat partitions; its groups of the model's own tensors are aligned with them
own = getattr(optimizer, "bit16_groups", None) or optimizer.fp16_groups
groups = [{"use_muon": bool(g.get("use_muon")), "params": sorted(names[id(p)] for p in params)}
          for g, params in zip(inner.param_groups, own, strict=True)]
print("MUON_GROUPS=" + json.dumps({"optimizer": type(inner).__name__, "groups": groups}), flush=True)
