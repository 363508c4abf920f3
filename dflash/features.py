"""Target features captured once, read by many runs: a feature store.

The frozen target's tapped features (and its final states, which the walk at T > 0 and the
distribution-matching losses read) of every sample of a token store, written once by
`launch/capture_features.py` and read by training and evaluation (`--features DIR`) without loading
the target: a recipe sweep pays the target's forward once instead of once per run and epoch.

Folder: `features.bin` (tokens x K*H) and `states.bin` (tokens x H), raw arrays in the target's
dtype in the token store's sample order, memory-mapped; `offsets.npy` (samples + 1) the first
token of each sample; `shared.safetensors` the embedding and the lm_head the drafter borrows;
`feature_store.json` (written last: a folder without it is incomplete) the dtype, the shapes, the
target's config and the fingerprints of what the features are of: the target
(`TargetSpec.fingerprint`: by content, `dflash.identity`, whatever path names it), the data (a hash
of the store's token ids and loss masks) and the tapped layers. A run whose target, data or taps
differ is refused in one line. The meta also names the engine that computed the features:
transformers, or vLLM (`capture_features.py --engine vllm`: `dflash.serving.vllm_features`), whose
store is the same but for its features' rounding (fp32 on the CPU: within about 1e-6 of the largest
value; `tests/serving/test_capture_vllm.py`).

Captured per sample on the packed path, which gives every sample the same bits alone as in any
packed micro-batch (a row's matmul does not depend on the rows beside it on the CPU; GPU kernels
chosen by shape may differ in the last bits); padded micro-batches computed online differ from
the packed path by rounding, so a padded run reads the packed path's features.
Disk: (K + 1) x H x bytes per token (SmolLM2-135M, K = 5, fp32: 13,824 bytes; bf16 half that).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from dflash.errors import UserError
from dflash.identity import same_target

META = "feature_store.json"
VERSION = 1
DTYPES = {"float32": (torch.float32, np.float32), "bfloat16": (torch.bfloat16, np.uint16),
          "float16": (torch.float16, np.float16)}


def data_fingerprint(store) -> str:
    """A hash of a token store's samples: their token ids and loss masks, in order."""
    h = hashlib.sha256()
    for i in range(len(store)):
        ids, mask = store[i]
        h.update(np.int64(len(ids)).tobytes() + ids.astype(np.int32).tobytes() + mask.tobytes())
    return h.hexdigest()


def bytes_per_token(num_layers: int, hidden: int, dtype: torch.dtype) -> int:
    """Disk per token: the K tapped layers and the final states, each `hidden` wide."""
    return (num_layers + 1) * hidden * torch.empty((), dtype=dtype).element_size()


def capture(target, spec, store, out: Path, *, token_budget: int = 16384, progress: bool = True) -> dict:
    """Write the feature store of `store` (a TokenStore) for `target` (a LoadedTarget) into `out`, in
    packed micro-batches of consecutive samples up to `token_budget` tokens (`write_store`). Returns the meta."""
    from dflash.data.collate import collate

    model = target.model
    device = model.shared_weights().embed.device

    def features_of(samples: list[int]):
        return model.features(collate(store, samples, "packed").to(device), with_output=True)

    return write_store(out, spec, store, features_of, taps=list(model.target_layer_ids),
                       shared=model.shared_weights(), config=target.hf.config.to_dict(), engine="transformers",
                       token_budget=token_budget, progress=progress)


def write_store(out: Path, spec, store, features_of, *, taps: list[int], shared, config: dict, engine: str,
                token_budget: int = 16384, progress: bool = True) -> dict:
    """Write the feature store of `store` into `out`: `features_of(samples)` gives the tapped features
    (tokens, K*H) and final states (tokens, H) of consecutive samples, in packed order, asked for up to
    `token_budget` tokens at a time; `shared` the embedding and lm_head the drafter borrows, `config`
    the target's config, `engine` what computed the features. The meta goes last (and first goes the
    old one: an interrupted capture leaves no store that reads as whole). Returns the meta."""
    from tqdm import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / META).unlink(missing_ok=True)
    hidden = int(config["hidden_size"])
    weight = shared.embed
    dtype_name = str(weight.dtype).removeprefix("torch.")
    if dtype_name not in DTYPES:
        raise UserError(f"--dtype: features of a {dtype_name} target cannot be stored (float32, bfloat16, float16)")
    np_dtype = DTYPES[dtype_name][1]
    lengths = store.lengths
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    total = int(offsets[-1])
    features = np.memmap(out / "features.bin", dtype=np_dtype, mode="w+", shape=(max(total, 1), len(taps) * hidden))
    states = np.memmap(out / "states.bin", dtype=np_dtype, mode="w+", shape=(max(total, 1), hidden))
    bar = tqdm(total=total, unit="tok", desc="capture", disable=not progress, dynamic_ncols=True)
    i = 0
    while i < len(store):
        j = i + 1
        while j < len(store) and offsets[j + 1] - offsets[i] <= token_budget:
            j += 1
        f, s = features_of(list(range(i, j)))
        lo, hi = int(offsets[i]), int(offsets[j])
        features[lo:hi] = _to_numpy(f)
        states[lo:hi] = _to_numpy(s)
        bar.update(hi - lo)
        i = j
    bar.close()
    features.flush()
    states.flush()
    del features, states
    np.save(out / "offsets.npy", offsets)
    from safetensors.torch import save_file

    tensors = {"embed": shared.embed.detach().cpu().contiguous()}
    if shared.lm_head is not shared.embed:
        tensors["lm_head"] = shared.lm_head.detach().cpu().contiguous()
    save_file(tensors, str(out / "shared.safetensors"))
    meta = {"version": VERSION, "dtype": dtype_name, "hidden_size": hidden, "target_layer_ids": taps,
            "samples": len(store), "tokens": total, "bytes_per_token": bytes_per_token(len(taps), hidden, weight.dtype),
            "target": spec.fingerprint(), "data": {"path": str(Path(store.path).resolve()),
                                                   "sha256": data_fingerprint(store)},
            "config": config, "tied": "lm_head" not in tensors, "engine": engine}
    (out / META).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    return (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy()


def read_meta(folder: Path, flag: str = "--features") -> dict:
    path = Path(folder) / META
    if not path.is_file():
        raise UserError(f"{flag} {folder}: not a whole feature store (no {META}; an interrupted capture leaves "
                        "none): capture one with launch/capture_features.py")
    meta = json.loads(path.read_text())
    if meta.get("version") != VERSION:
        raise UserError(f"{flag} {folder}: feature store version {meta.get('version')} is not {VERSION}; capture it "
                        "again")
    return meta


def check_matches(meta: dict, folder, *, spec, store, target_layer_ids, flag: str = "--features") -> None:
    """Refuse, in one line, a store captured of another target, other data or other tapped layers."""
    if not same_target(meta["target"], spec.fingerprint(known=meta["target"])):
        raise UserError(f"{flag} {folder}: captured from another target ({meta['target'].get('path')}) than --target "
                        f"{spec.name}, or the target's weights changed since; capture again")
    if list(target_layer_ids) != meta["target_layer_ids"]:
        raise UserError(f"{flag} {folder}: captured at target layers {meta['target_layer_ids']}, the run taps "
                        f"{list(target_layer_ids)}; capture again or give --target-layer-ids "
                        f"{','.join(map(str, meta['target_layer_ids']))}")
    if len(store) != meta["samples"] or data_fingerprint(store) != meta["data"]["sha256"]:
        raise UserError(f"{flag} {folder}: captured from other data ({meta['data']['path']}) than the run's token "
                        f"store {store.path}; capture again from the same store")


def check_files(folder, meta: dict, flag: str = "--features") -> None:
    """Refuse, in one line naming the file, a store whose arrays are missing or not the size its meta
    says (a cut copy, a deleted file): memory-mapping one would fail with numpy's words, or read wrong rows."""
    from dflash.folders import safetensors_shapes

    folder = Path(folder)
    item = np.dtype(DTYPES[meta["dtype"]][1]).itemsize
    rows, hidden = max(meta["tokens"], 1), meta["hidden_size"]
    sizes = {"features.bin": rows * len(meta["target_layer_ids"]) * hidden * item, "states.bin": rows * hidden * item}
    for name in (*sizes, "offsets.npy", "shared.safetensors"):
        if not (folder / name).is_file():
            raise UserError(f"{flag} {folder}: {name} is missing (the store's {META} lists it); capture again")
    for name, size in sizes.items():
        actual = (folder / name).stat().st_size
        if actual != size:
            raise UserError(f"{flag} {folder / name}: {actual:,} bytes where the store's {META} makes {size:,} (cut "
                            "short or replaced); capture again")
    try:
        offsets = np.load(folder / "offsets.npy")
    except (OSError, ValueError) as e:
        raise UserError(f"{flag} {folder / 'offsets.npy'}: unreadable ({e}); capture again") from None
    if offsets.shape != (meta["samples"] + 1,) or int(offsets[-1]) != meta["tokens"]:
        raise UserError(f"{flag} {folder / 'offsets.npy'}: does not hold the {meta['samples'] + 1} offsets of the "
                        f"store's {meta['tokens']:,} tokens; capture again")
    safetensors_shapes(folder / "shared.safetensors", flag)


class CapturedTarget(torch.nn.Module):
    """Stands in for `TargetModel` where only features are read: `features(batch)` returns, from the
    memory-mapped store, what the packed path computes for the batch's samples. `model` holds the
    borrowed embedding and lm_head (so the target's memory counts what is resident)."""

    def __init__(self, folder, meta: dict, device, dtype: torch.dtype):
        super().__init__()
        from safetensors.torch import load_file

        folder = Path(folder)
        self.target_layer_ids = list(meta["target_layer_ids"])
        np_dtype = DTYPES[meta["dtype"]][1]
        self._torch_dtype = DTYPES[meta["dtype"]][0]
        k, h, n = len(self.target_layer_ids), meta["hidden_size"], max(meta["tokens"], 1)
        self._features = np.memmap(folder / "features.bin", dtype=np_dtype, mode="r", shape=(n, k * h))
        self._states = np.memmap(folder / "states.bin", dtype=np_dtype, mode="r", shape=(n, h))
        self._offsets = np.load(folder / "offsets.npy")
        tensors = load_file(str(folder / "shared.safetensors"))
        self.model = torch.nn.Module()
        self.model.embed = torch.nn.Parameter(tensors["embed"].to(device, dtype), requires_grad=False)
        lm_head = tensors.get("lm_head")
        self.model.lm_head = self.model.embed if lm_head is None else torch.nn.Parameter(
            lm_head.to(device, dtype), requires_grad=False)
        self.device, self.dtype = device, dtype

    @property
    def num_embedding_rows(self) -> int:
        return self.model.embed.shape[0]

    def shared_weights(self):
        from dflash.target.model import SharedWeights

        return SharedWeights(embed=self.model.embed, lm_head=self.model.lm_head)

    def _rows(self, array: np.memmap, batch) -> torch.Tensor:
        lengths = (batch.lengths if batch.layout == "padded" else batch.cu_seqlens_cpu.diff()).tolist()
        parts = [array[self._offsets[s]:self._offsets[s] + n] for s, n in zip(batch.sample_ids.tolist(), lengths,
                                                                                strict=True)]
        t = torch.from_numpy(np.concatenate(parts))
        if self._torch_dtype == torch.bfloat16:
            t = t.view(torch.bfloat16)
        return t.to(self.device, self.dtype)

    @torch.no_grad()
    def features(self, batch, *, with_output: bool = False):
        """The tapped features (tokens, K*H) of the batch's samples in packed order; with `with_output`
        also the final states (tokens, H), as `TargetModel.features`."""
        f = self._rows(self._features, batch)
        return (f, self._rows(self._states, batch)) if with_output else f


def load_captured(folder, spec, store, device, dtype, target_layer_ids) -> CapturedTarget:
    """The model that reads the feature store at `folder` in place of the target (checked against the
    run's target, data and taps)."""
    meta = read_meta(folder)
    check_matches(meta, folder, spec=spec, store=store, target_layer_ids=target_layer_ids)
    check_files(folder, meta)
    return CapturedTarget(folder, meta, device, dtype)
