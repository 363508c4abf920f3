"""What a regeneration is asked to do: `RegenerateConfig`, checked before any model loads, and the
settings every output line records (a resumed run must agree with the lines it keeps)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dflash.data.sources import open_source
from dflash.errors import UserError
from dflash.partial import check_apart

BACKENDS = ("auto", "hf", "vllm", "sglang")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# meta fields that change what is generated: a resumed run must agree with the lines it keeps (the
# target by content: each line records its `target_sha256`, `dflash.identity`)
SETTINGS = ("target", "temperature", "seed", "max_new_tokens", "keep_thinking")


@dataclass
class RegenerateConfig:
    target: str  # the target as --target names it: a model folder, a Hub id, a .gguf file (`resolve_target`)
    input: str  # conversations in any format of dflash.data.sources (`messages` or ShareGPT `conversations`)
    output: str  # JSONL written in the `messages` form; appended to when it exists (resume)
    max_new_tokens: int = 2048  # per assistant turn
    temperature: float = 0.0  # 0 = greedy
    seed: int | None = None  # sampling seed; defaults to 0 when temperature > 0
    batch_size: int = 16  # conversations per generation batch
    keep_thinking: bool = False  # keep `<think>...</think>` in stored responses
    skip_bad: bool = False  # skip bad input lines (counted) instead of stopping
    backend: str = "auto"  # auto | hf | vllm | sglang
    dtype: str = "auto"  # auto: bfloat16 on a GPU, float32 on the CPU
    target_name: str | None = None  # what `meta.target` records; defaults to the path as given
    limit: int | None = None  # regenerate only the first `limit` valid conversations
    messages_field: str | None = None  # the input's conversation column (default: messages, else conversations)
    split: str | None = None  # the split of an input that holds several (a Hub folder, a DatasetDict)
    _spec: object = field(default=None, init=False, repr=False, compare=False)

    @property
    def target_spec(self):
        """The resolved target (`dflash.target.spec`), read once."""
        if self._spec is None:
            from dflash.target.spec import load_target_spec

            self._spec = load_target_spec(self.target)
        return self._spec

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.batch_size < 1:
            raise UserError(f"--batch-size must be at least 1, got {self.batch_size}")
        if self.temperature < 0:
            raise UserError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.temperature == 0 and self.seed is not None:
            raise UserError("--seed only applies to sampling; give --temperature > 0 or drop --seed")
        if self.backend not in BACKENDS:
            raise UserError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.dtype not in DTYPES:
            raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.limit is not None and self.limit < 1:
            raise UserError(f"--limit must be at least 1, got {self.limit}")
        if self.target_spec.random:
            raise UserError(f"--target {self.target}: a random target has no chat model to answer with")
        # the format and columns, one line if wrong
        open_source(self.input, messages_field=self.messages_field, split=self.split)
        check_apart(self.output, {"--input": self.input,
                                  "--target": self.target if Path(self.target).exists() else None}, "--output")
        if not Path(self.output).resolve().parent.is_dir():
            raise UserError(f"--output {self.output}: the folder {Path(self.output).parent} does not exist")
        if Path(self.output).exists() and not Path(self.output).is_file():
            kind = "a folder" if Path(self.output).is_dir() else "not a regular file"
            raise UserError(f"--output {self.output}: is {kind}; give the path of a JSONL file to write")

    @property
    def sampling_seed(self) -> int | None:
        return (0 if self.seed is None else self.seed) if self.temperature > 0 else None

    def settings(self) -> dict:
        return {
            "target": self.target_name or self.target, "temperature": self.temperature,
            "seed": self.sampling_seed, "max_new_tokens": self.max_new_tokens,
            "keep_thinking": self.keep_thinking,
        }
