"""The target, resolved once from `--target` before anything loads: `TargetSpec`.

`--target` is a Hugging Face model folder, a Hub id (`ORG/NAME`: the snapshot in the Hugging Face
cache, downloaded first when online), a `.gguf` file or a folder holding one (transformers
dequantizes it; its tokenizer and chat template come from the file), `random:PRESET` (a row of
`PRESETS`) or `random:PATH` (the shape of the model whose config.json is at PATH, random
weights); every command resolves it here, once (`resolve_target`). The sizing tools
(`launch/plan_memory.py`, `launch/plan_batches.py`) also take a bare preset name or a config.json.
Everything decided before loading reads the spec: the memory plan, the drafter settings and
`--init-drafter`'s check, the tapped layers, the mask token's embedding row, the loader, the
partition, the FLOP model, the end-of-turn tokens and the identity (`fingerprint`) that `--resume`,
`--features` and regeneration compare.

Resolution refuses, in one line naming the flag or the file, a family dflash has no feature
path for and a config.json that leaves a size to transformers' defaults (which would plan and
build a model nobody has).
"""
from __future__ import annotations

import copy
import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.errors import UserError

RANDOM_PREFIX = "random:"
GGUF_SUFFIX = ".gguf"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # ORG/NAME, as the Hub names repositories
# What a Hub id downloads: a transformers checkpoint (config, tokenizer, safetensors), not every file
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]

# model_type -> what the packed path does beyond dense attention (the README "Targets" table)
TARGET_FAMILIES = {
    "qwen3": "dense",
    "qwen2": "dense (q/k/v biases; sliding-window layers where configured)",
    "llama": "dense",
    "mistral": "dense (sliding window where configured)",
    "qwen3_moe": "MoE (Qwen3-Coder-30B-A3B, Qwen3-235B-A22B)",
    "qwen3_5_text": "hybrid: Gated DeltaNet + gated full attention (Qwen3.5 / 3.6 dense)",
    "qwen3_5_moe_text": "hybrid + MoE (Qwen3.5 / 3.6 MoE)",
    "gpt_oss": "sliding window + attention sinks, MoE (gpt-oss-20b / 120b)",
    "deepseek_v3": "MLA (q/k head dim 192, v 128) + MoE (DeepSeek-V3, Kimi-K2.5)",
}
SUPPORTED_MODEL_TYPES = tuple(TARGET_FAMILIES)

# Public config.json fields of named targets (the language model's text config): the README plans
# them, `random:NAME` builds them, the cost model prices them.
PRESETS = {
    "qwen3-8b": dict(model_type="qwen3", tie_word_embeddings=False, hidden_size=4096, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288, num_hidden_layers=36,
                     vocab_size=151936),
    "qwen3.5-27b": dict(model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                        num_attention_heads=24, num_key_value_heads=4, head_dim=256, vocab_size=248320,
                        tie_word_embeddings=False, full_attention_interval=4, attn_output_gate=True,
                        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                        linear_value_head_dim=128, linear_conv_kernel_dim=4),
    "qwen3.5-122b-a10b": dict(model_type="qwen3_5_moe_text", hidden_size=3072, num_hidden_layers=48,
                              num_attention_heads=32, num_key_value_heads=2, head_dim=256, vocab_size=248320,
                              tie_word_embeddings=False, full_attention_interval=4, attn_output_gate=True,
                              linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128,
                              linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256,
                              num_experts_per_tok=8, moe_intermediate_size=1024, shared_expert_intermediate_size=1024),
}

SIZE_KEYS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")


def is_random_target(target: str) -> bool:
    return str(target).startswith(RANDOM_PREFIX)


def target_folder(target: str) -> Path | None:
    """The folder `--target` is read from; None for a random target (made in memory)."""
    return None if is_random_target(target) else Path(target)


def missing_sizes(fields: dict) -> list[str]:
    """The sizes a config.json (its text config's fields) does not give."""
    missing = [k for k in SIZE_KEYS if k not in fields]
    if not any(k in fields for k in ("intermediate_size", "moe_intermediate_size")):
        missing.append("intermediate_size")
    return missing


def read_config_json(path: Path) -> dict:
    """The text config's fields of a config.json (multimodal configs nest the language model's)."""
    try:
        fields = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot read a JSON config ({e})") from None
    if not isinstance(fields, dict):
        raise UserError(f"{path}: not a JSON object")
    nested = fields.get("text_config")
    return nested if isinstance(nested, dict) else fields


@dataclass(frozen=True)
class TargetSpec:
    """What is known of the target before its weights load."""

    name: str  # as given (e.g. "random:qwen3-8b", a folder)
    config: Any  # the language model's transformers config (the text config of an image-text model)
    folder: Path | None  # the model folder (a Hub id's snapshot); None for a preset or a random target
    random: bool  # random weights and a synthetic tokenizer, built in memory
    gguf_file: str | None = None  # the .gguf file in `folder` the weights and tokenizer come from

    @property
    def load_kwargs(self) -> dict:
        """What transformers' `from_pretrained(folder, ...)` needs besides the folder (model, config, tokenizer)."""
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}

    @property
    def family(self) -> str:
        return self.config.model_type

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def embedding_rows(self) -> int:
        """The rows of the input embedding, as the config says."""
        return int(self.config.vocab_size)

    @property
    def positions(self) -> int | None:
        """The positions the target was made for (`max_position_embeddings`; None when its config has none)."""
        value = getattr(self.config, "max_position_embeddings", None)
        return int(value) if value else None

    def default_layer_ids(self, num_features: int) -> list[int]:
        """The official tap rule for this target's depth."""
        from dflash.target.taps import default_target_layer_ids

        return default_target_layer_ids(self.num_layers, num_features)

    def layer_ids(self, given=None, num_features: int = 5) -> list[int]:
        """The tapped layers from the config alone, before any weight loads: `given` (--target-layer-ids)
        checked against the depth, else the official rule for `num_features` (--num-target-features);
        one line naming the option when the target cannot give them."""
        from dflash.target.taps import check_target_layer_ids

        try:
            return check_target_layer_ids(given, self.num_layers) if given else self.default_layer_ids(num_features)
        except ValueError as e:
            flag = "--target-layer-ids" if given else f"--num-target-features {num_features}"
            raise UserError(f"{flag} with --target {self.name}: {e}") from None

    def generation_eos(self):
        """The eos id(s) of the model's generation config (or its config), without loading weights;
        None for a target with no folder (its tokenizer's eos ends turns)."""
        if self.folder is None:
            return None
        from transformers import GenerationConfig

        if self.gguf_file:
            return self.config.eos_token_id
        try:
            return GenerationConfig.from_pretrained(str(self.folder)).eos_token_id
        except OSError:
            return json.loads((self.folder / "config.json").read_text()).get("eos_token_id")

    def fingerprint(self, known: dict | None = None) -> dict:
        """The target's identity by content (`dflash.identity.target_identity`: config.json and the
        weight files it loads, each hashed whole; `known`, an earlier record, spares hashing the
        files unchanged since). A moved or copied model, or a .gguf behind a link of another name,
        is the same target; a `random:` target is its name."""
        from dflash.identity import target_identity

        return target_identity(self.folder, self.gguf_file, self.name, known)


def _preset_config(name: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(**PRESETS[name])


def _folder_config(path: Path, flag: str, name: str):
    """The text config of the model whose config.json is at `path` (a folder or the file), refused
    when unreadable, of a family dflash does not support, or missing a size."""
    from transformers import AutoConfig

    if path.is_file() and path.name == "config.json":
        path = path.parent
    file = path / "config.json"
    try:
        config = AutoConfig.from_pretrained(str(path)).get_text_config(decoder=True)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"{flag} {name}: cannot read {file} as a transformers config ({e})") from None
    check_family(config.model_type, f"{flag} {name}")
    missing = missing_sizes(read_config_json(file))
    if missing:
        raise UserError(f"{file}: missing {', '.join(missing)}; a target's config.json gives the model's sizes "
                        "(transformers' defaults would plan a model nobody has)")
    return config


def check_family(model_type: str, where: str) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"{where}: model_type {model_type!r} is not a target dflash supports (supported: "
                        f"{', '.join(SUPPORTED_MODEL_TYPES)})")


def gguf_config(folder: Path, gguf_file: str, flag: str, name: str):
    """The config of a .gguf file (read once per process and file version: transformers parses all
    of its metadata, the tokenizer's too, seconds for a 49K vocabulary; the target's load reuses it)."""
    path = folder / gguf_file
    stat = path.stat()
    try:
        config = _read_gguf_config(str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    except ImportError as e:  # the `gguf` package reads the file
        raise UserError(f"{flag} {name}: reading a .gguf file needs the gguf package (pip install gguf): {e}") \
            from None
    except Exception as e:  # noqa: BLE001  a foreign file's reader raises what it meets (struct.error, ...)
        raise UserError(f"{flag} {name}: cannot read {path} as a GGUF model ({e})") from None
    check_family(config.model_type, f"{flag} {name}")
    return copy.deepcopy(config)


@functools.lru_cache(maxsize=4)
def _read_gguf_config(path: str, size: int, mtime_ns: int):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name)


def hub_snapshot(repo_id: str, flag: str = "--target") -> Path:
    """The folder of Hub model `repo_id` in the Hugging Face cache (HF_HUB_CACHE); downloaded
    (config, tokenizer, safetensors) when it is not there and the hub is reachable."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise UserError(f"{flag} {repo_id}: not a folder or file here, and not in the Hugging Face cache "
                        f"({constants.HF_HUB_CACHE}) while HF_HUB_OFFLINE is set") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except RepositoryNotFoundError:
        raise UserError(f"{flag} {repo_id}: no such folder or file here, and no such model on the Hugging Face Hub "
                        "(or it is gated: log in with `hf auth login`)") from None
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{flag} {repo_id}: not a folder or file here, not in the Hugging Face cache, and the "
                        f"download failed ({reason})") from None


def resolve_target(name: str, flag: str = "--target") -> tuple[Path, str | None]:
    """Where the model `name` is: (its folder, the .gguf file in it or None). `name` is a model
    folder, a .gguf file, a folder holding one .gguf file (and no config.json), or a Hub id."""
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix != GGUF_SUFFIX:
            raise UserError(f"{flag} {name}: a file that is not a .gguf model; give a Hugging Face model folder, "
                            "a .gguf file or a Hub id (ORG/NAME)")
        return path.parent, path.name
    if path.is_dir():
        if (path / "config.json").is_file():
            return path, None
        ggufs = sorted(p.name for p in path.glob(f"*{GGUF_SUFFIX}"))
        if len(ggufs) == 1:
            return path, ggufs[0]
        if ggufs:
            raise UserError(f"{flag} {name}: holds {len(ggufs)} .gguf files ({', '.join(ggufs[:4])}); give the one "
                            "to load")
        raise UserError(f"{flag} {name}: not a Hugging Face model folder (no config.json, no .gguf file)")
    if HUB_ID.match(name) and not os.path.exists(path.parent):
        return resolve_target(str(hub_snapshot(name, flag)), flag)
    raise UserError(f"{flag} {name}: no such folder or file, and not a Hugging Face Hub id (ORG/NAME)")


def load_target_spec(target: str | Path, flag: str = "--target", *, bare_presets: bool = False) -> TargetSpec:
    """The spec of `target`: a model folder, a Hub id, a .gguf file (or a folder of one), `random:PRESET`
    or `random:PATH`; with `bare_presets` (the sizing tools) also a preset name or a config.json.
    Refused (UserError) in one line before any heavy work."""
    name = str(target)
    if is_random_target(name):
        shape = name[len(RANDOM_PREFIX):]
        if shape in PRESETS:
            return TargetSpec(name, _preset_config(shape), None, True)
        path = Path(shape)
        if not ((path / "config.json").is_file() or (path.is_file() and path.name == "config.json")):
            raise UserError(f"{flag} {name}: expected random:PRESET ({', '.join(PRESETS)}) or random:PATH with a "
                            f"config.json at PATH")
        return TargetSpec(name, _folder_config(path, flag, name), None, True)
    if bare_presets and name in PRESETS:
        return TargetSpec(name, _preset_config(name), None, False)
    path = Path(name)
    if bare_presets and path.is_file() and path.name == "config.json":
        return TargetSpec(name, _folder_config(path, flag, name), None, False)
    if name in PRESETS and not Path(name).exists():
        raise UserError(f"{flag} {name}: a preset is a shape without weights; give random:{name} (random weights) "
                        "or the model's folder, Hub id or .gguf file")
    try:
        folder, gguf_file = resolve_target(name, flag)
    except UserError:
        if bare_presets:
            raise UserError(f"{flag} {name}: neither a preset ({', '.join(PRESETS)}) nor a config.json, a Hugging "
                            "Face model folder, a .gguf file or a Hub id") from None
        raise
    if gguf_file:
        return TargetSpec(name, gguf_config(folder, gguf_file, flag, name), folder, False, gguf_file)
    return TargetSpec(name, _folder_config(folder, flag, name), folder, False)
