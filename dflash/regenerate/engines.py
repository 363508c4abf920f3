"""The generation engines: a batch of token-id prompts in, one `Generation` per prompt out (Hugging
Face `generate`, vLLM or SGLang offline engines), and the tokenizer they are fed through.

They run the target, loaded through `dflash.target` on first use (regeneration sits above the target
room for that, and comes before the token store).
"""
from __future__ import annotations

from dataclasses import dataclass

from dflash.data.generation import stop_ids
from dflash.errors import UserError
from dflash.regenerate.config import RegenerateConfig


@dataclass
class Generation:
    token_ids: list[int]  # generated tokens, without the stop token
    hit_limit: bool  # stopped by max_new_tokens, not by an end-of-turn token


def _cut(tokens: list[int], stops: list[int], max_new_tokens: int) -> Generation:
    for i, t in enumerate(tokens):
        if t in stops:
            return Generation(tokens[:i], False)
    return Generation(tokens, len(tokens) >= max_new_tokens)


class HFBackend:
    """Hugging Face `generate` on left-padded batches (GPU when there is one, else the CPU)."""

    name = "hf"

    def __init__(self, spec, tokenizer, dtype: str):
        import torch
        from transformers import GenerationConfig

        from dflash.target.model import load_language_model

        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if dtype == "auto":
            dtype = "bfloat16" if self.device == "cuda" else "float32"
        # any TargetModel family; an image-text checkpoint: its language model only
        self.model = load_language_model(spec.folder, getattr(torch, dtype), self.device, **spec.load_kwargs)
        self.model.eval()
        self.stops = stop_ids(tokenizer, self.model.generation_config.eos_token_id)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stops[0]
        # `generate` fills every unset option from the model's generation config (Qwen3 ships
        # top_k/top_p/temperature); a bare one makes greedy plain argmax and sampling plain
        # temperature sampling.
        self.model.generation_config = GenerationConfig(eos_token_id=self.stops, pad_token_id=self.pad)

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float,
                 seeds: list[int] | None) -> list[Generation]:
        from transformers import GenerationConfig

        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        config = GenerationConfig(
            max_new_tokens=max_new_tokens, do_sample=temperature > 0, eos_token_id=self.stops, pad_token_id=self.pad,
            **({"temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {}),
        )
        if seeds is not None:
            # `generate` draws from the global generator: one seed per batch is all it can take
            torch.manual_seed(seeds[0])
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), generation_config=config
            )
        new = out[:, width:].tolist()
        return [_cut(row, self.stops, max_new_tokens) for row in new]


class VLLMBackend:
    """vLLM offline engine (`dflash.serving.vllm.VLLMEngine`: on the CPU in this process, one thread),
    fed token ids (so it sees exactly the rendered chat template); a .gguf target is loaded from the
    Hugging Face folder it is written to once (`engine_folder`)."""

    name = "vllm"

    def __init__(self, spec, tokenizer, dtype: str, seed: int | None):
        import torch

        from dflash.serving.vllm import VLLMEngine, engine_folder

        if dtype == "auto":  # as HFBackend: the engine's own auto would take the checkpoint's (bf16) on the CPU
            dtype = "bfloat16" if torch.cuda.is_available() else "float32"
        self.engine = VLLMEngine(engine_folder(spec), dtype=dtype, seed=seed or 0)
        self.stops = stop_ids(tokenizer, spec.generation_eos())

    def generate(self, prompts, *, max_new_tokens, temperature, seeds) -> list[Generation]:
        outs = self.engine.generate(prompts, max_new_tokens=max_new_tokens, stop_ids=self.stops,
                                    temperature=temperature, seeds=seeds)
        return [_cut(o.tokens, self.stops, max_new_tokens) for o in outs]


class SGLangBackend:
    """SGLang offline engine, fed token ids."""

    name = "sglang"

    def __init__(self, spec, tokenizer, dtype: str, seed: int | None):
        import sglang

        self.engine = sglang.Engine(model_path=_engine_path(spec), dtype=dtype, random_seed=seed or 0,
                                    log_level="error")
        self.stops = stop_ids(tokenizer, spec.generation_eos())

    def generate(self, prompts, *, max_new_tokens, temperature, seeds) -> list[Generation]:
        params = [
            {
                "temperature": temperature, "top_p": 1.0, "top_k": -1, "max_new_tokens": max_new_tokens,
                "stop_token_ids": self.stops, "skip_special_tokens": False,
                **({} if seeds is None else {"sampling_seed": seeds[i]}),
            }
            for i in range(len(prompts))
        ]
        outs = self.engine.generate(input_ids=prompts, sampling_params=params)
        return [
            Generation(_cut(list(o["output_ids"]), self.stops, max_new_tokens).token_ids,
                       o["meta_info"]["finish_reason"]["type"] == "length")
            for o in outs
        ]


def _engine_path(spec) -> str:
    """What vLLM and SGLang load: the model folder, or the .gguf file itself."""
    return str(spec.folder / spec.gguf_file) if spec.gguf_file else str(spec.folder)


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def choose_backend(name: str) -> str:
    """`auto`: vLLM when it is installed and a GPU is present, otherwise Hugging Face."""
    if name == "auto":
        import torch

        return "vllm" if _importable("vllm") and torch.cuda.is_available() else "hf"
    if name in ("vllm", "sglang") and not _importable(name):
        raise UserError(f"--backend {name}: {name} is not installed (use --backend hf or auto)")
    return name


def load_backend(cfg: RegenerateConfig, tokenizer):
    name = choose_backend(cfg.backend)
    if name == "hf":
        return HFBackend(cfg.target_spec, tokenizer, cfg.dtype)
    dtype = "auto" if cfg.dtype == "auto" else cfg.dtype
    cls = VLLMBackend if name == "vllm" else SGLangBackend
    return cls(cfg.target_spec, tokenizer, dtype, cfg.sampling_seed)


def load_tokenizer(target: str, spec=None):
    """The tokenizer of `--target` (any form `resolve_target` takes; `spec`: its TargetSpec, when
    resolved already), which must have a chat template."""
    from transformers import AutoTokenizer

    from dflash.target.spec import load_target_spec

    spec = spec or load_target_spec(target)
    tokenizer = AutoTokenizer.from_pretrained(str(spec.folder), **spec.load_kwargs)
    if not tokenizer.chat_template:
        raise UserError(f"--target {target}: the tokenizer has no chat template")
    return tokenizer
