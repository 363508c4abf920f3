"""Run under `deepspeed --num_gpus 2`: the target replicated, partitioned (ZeRO-3) and partitioned
with its partitions offloaded; packed and padded features of each must be bitwise equal, three
calls each (the first records DeepSpeed's trace, the later ones prefetch). Rank 0 prints one JSON
line per rank: whether all were equal, and the target bytes of each. Then, through the CLIs' exit
(`exit_on_user_error`), each rank prints the gloo threads left for interpreter shutdown."""
import glob
import json
import sys

import torch
import torch.distributed as dist

args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher adds it
target_path, store_path = args[0], args[1]

from dflash.data.collate import collate_packed, collate_padded  # noqa: E402
from dflash.data.token_store import TokenStore  # noqa: E402
from dflash.distributed.partition import largest_layer_numel, target_bytes  # noqa: E402
from dflash.distributed.process_group import init_distributed  # noqa: E402
from dflash.errors import exit_on_user_error  # noqa: E402
from dflash.target.spec import load_target_spec  # noqa: E402
from dflash.training.target import load_target  # noqa: E402

init_distributed()
rank = dist.get_rank()


@exit_on_user_error
def main():
    store = TokenStore(store_path)
    batches = [collate_packed(store, [0, 1, 2, 3]), collate_padded(store, [4, 5, 6], pad_id=0),
               collate_packed(store, [7])]
    kwargs = dict(target_layer_ids=[1, 2], attention_backend="torch")
    replicated = load_target(load_target_spec(target_path), "cpu", torch.float32, **kwargs)
    reference = [replicated.model.features(b) for b in batches]
    result = {"rank": dist.get_rank(), "equal": True}
    for name, extra in (("zero3", {}), ("offload", {"offload": True})):
        loaded = load_target(load_target_spec(target_path), "cpu", torch.float32, partition="zero3", **extra, **kwargs)
        model = loaded.model
        for _ in range(3):
            for batch, expected in zip(batches, reference, strict=True):
                result["equal"] &= torch.equal(model.features(batch), expected)
        shared = model.shared_weights()
        result["equal"] &= torch.equal(shared.embed, replicated.model.shared_weights().embed)
        result["equal"] &= torch.equal(shared.lm_head, replicated.model.shared_weights().lm_head)
        result["equal"] &= loaded.mask_id == replicated.mask_id and model.num_embedding_rows == \
            replicated.model.num_embedding_rows
        layers = loaded.hf.model.layers
        result[name] = {**target_bytes(model), "layer": largest_layer_numel(loaded.hf) * 4,
                        "tensor": max(p.ds_numel for layer in layers for p in layer.parameters()) * 4}
    result["replicated"] = target_bytes(replicated.model)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, result)
    if dist.get_rank() == 0:  # one line per rank, from one process: never interleaved
        print("\n".join(json.dumps(r) for r in every), flush=True)


main()
left = [name for name in (open(f).read().strip() for f in glob.glob("/proc/self/task/*/comm")) if "gloo" in name]
sys.stdout.write(json.dumps({"rank_at_exit": rank, "gloo_threads": sorted(left)}) + "\n")  # one write per rank
sys.stdout.flush()
