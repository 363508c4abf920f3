import functools
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

# Without CUDA, Triton kernels run in its numpy interpreter, which must be switched on before
# anything imports triton (transformers may, during the model tests that run before tests/ops).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def launch_script(name: str):
    """launch/NAME.py as a module, loaded from its file (launch/ is a folder of scripts, not a
    package, and putting it on sys.path would let its names shadow installed modules)."""
    spec = importlib.util.spec_from_file_location(f"launch_{name}", ROOT / "launch" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSONL file (regenerate's outputs)."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def greedy_reference(model, tokenizer, messages: list[dict], max_new_tokens: int) -> str:
    """Greedy decoding without `generate`: full forward pass per token, argmax, stop at eos."""
    import torch

    ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                    add_special_tokens=False)["input_ids"]
    new = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = int(model(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax())
            if nxt == tokenizer.eos_token_id:
                break
            new.append(nxt)
    return tokenizer.decode(new, skip_special_tokens=True)


def poison_empty(monkeypatch):
    """torch.empty / empty_like return NaN-filled float tensors, so outputs a kernel or model
    leaves unwritten show up as NaN instead of passing on whatever memory held."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))
    # A `with torch.device(...)` block redirects the constructors torch caches at its first use; a
    # first use under this patch would cache the lambda, not torch.empty, and every later
    # `with torch.device("meta")` of the session would build real tensors (a 122B model in CPU
    # memory). So the test gets its own cache, and the session's is back at teardown.
    import torch.utils._device as device_context

    monkeypatch.setattr(device_context, "_device_constructors",
                        functools.lru_cache(1)(device_context._device_constructors.__wrapped__))


def make_chat_tokenizer(words=None):
    """A small word-level fast tokenizer with a ChatML template, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = words or [f"w{i}" for i in range(50)] + ["hello", "world", "the", "answer", "is", "user", "assistant",
                                                     "system"]
    specials = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + ["\n"] + sorted(set(words)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split("\n", behavior="isolated"), pre_tokenizers.WhitespaceSplit()]
    )
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<|im_end|>")
    fast.chat_template = CHATML
    return fast


def make_bpe_chat_tokenizer(words):
    """A small byte-level BPE tokenizer with a ChatML template, trained offline on `words`: what
    transformers accepts for model types that force a BPE tokenizer class (Qwen3.5)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join([*words, "user", "assistant", "system"])] * 3 + ["\n"], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<|im_end|>")
    fast.chat_template = CHATML
    return fast


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module: tiny ops on shared cores cost far more in threads than in work
    (100x measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def demo():
    """The demo target and its greedy turns (tests/demo_turns.py), built once for the decoding and the
    evaluator tests, on one intra-op thread."""
    from .demo_turns import demo_turns

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return demo_turns()
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def chat_tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    make_chat_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_run_inputs(tmp_path_factory):
    """A tiny random Qwen3 target and a small conversation file (tests/runs.py), for every room's runs."""
    from .runs import make_conversations, make_tiny_target

    root = tmp_path_factory.mktemp("tiny")
    return make_tiny_target(root / "target"), make_conversations(root / "data.jsonl")


@pytest.fixture(scope="session")
def tiny_store(tiny_run_inputs, tmp_path_factory):
    """The tiny conversations prepared into a token store with the tiny target's tokenizer."""
    from dflash.data import prepare_jsonl

    target, data = tiny_run_inputs
    out = tmp_path_factory.mktemp("store") / "store"
    prepare_jsonl(data, str(target), out, progress=False)
    return out


# The model rooms' tests (once tests/models) run one intra-op thread per module and with torch.empty
# NaN-poisoned, so that a read of memory never written shows; tests/ops has its own poisoning.
MODEL_ROOMS = {"models", "drafter", "target", "objective", "decoding"}


def _in_model_room(request) -> bool:
    path = Path(request.path).resolve()
    return path.parent.parent == ROOT / "tests" and path.parent.name in MODEL_ROOMS


@pytest.fixture(autouse=True, scope="module")
def model_room_one_thread(request):
    if _in_model_room(request):
        request.getfixturevalue("one_thread")
    yield


@pytest.fixture(autouse=True)
def nan_poisoned_empty(request, monkeypatch):
    if _in_model_room(request):
        poison_empty(monkeypatch)
