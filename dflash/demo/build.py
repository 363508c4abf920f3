"""Build the demo assets: a synthetic chat language, its tokenizer, a tiny Qwen3 target trained on
it, a prompt set, and the dataset that target regenerated from those prompts.

The language is a handful of tasks whose answers are deterministic but non-trivial functions of
the prompt (counting, parity lists, reversing, sorting, sums with an optional `<think>` trace,
repeating patterns, templated descriptions and stories), with system prompts that change the
style and multi-turn follow-ups that refer back to the previous answer. A target trained briefly
on it answers in that structure, so a drafter conditioned on its hidden states has something
real to learn, and response lengths vary from a few tokens to a few hundred.

Everything is seeded: the same seed gives the same corpus, tokenizer, prompts and (on the same
machine and torch build) the same weights and regenerated dataset.
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

IM_START, IM_END, PAD, UNK = "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|unk|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

# ChatML, as Qwen uses it: every rendered prefix is a string prefix of the next one, which is
# what prepare_data relies on to find the assistant tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# noun -> (kind, colour, where it is found, what it does)
THINGS = {
    "apple": ("fruit", "red", "on a tree", "grows in the sun"),
    "river": ("place", "blue", "in a valley", "runs to the sea"),
    "stone": ("thing", "gray", "on the ground", "stays where it is"),
    "cloud": ("thing", "white", "in the sky", "moves with the wind"),
    "fox": ("animal", "red", "in the forest", "runs at night"),
    "tree": ("plant", "green", "in the forest", "grows very slowly"),
    "lamp": ("tool", "gold", "in a house", "gives light"),
    "boat": ("tool", "brown", "on the water", "carries people"),
    "bird": ("animal", "blue", "in the sky", "sings in the morning"),
    "road": ("place", "black", "between towns", "leads far away"),
    "hill": ("place", "green", "near the town", "looks over the fields"),
    "star": ("thing", "white", "in the sky", "shines at night"),
    "wolf": ("animal", "gray", "in the forest", "hunts with its pack"),
    "book": ("thing", "brown", "in a house", "holds many stories"),
    "door": ("thing", "brown", "in a house", "opens and closes"),
    "fish": ("animal", "gold", "in the water", "swims all day"),
    "moon": ("thing", "white", "in the sky", "shines at night"),
    "bell": ("tool", "gold", "in a tower", "rings at noon"),
    "seed": ("plant", "brown", "in the ground", "grows into a plant"),
    "cat": ("animal", "black", "in a house", "sleeps in the sun"),
    "cup": ("tool", "white", "on a table", "holds water"),
    "leaf": ("plant", "green", "on a tree", "falls in autumn"),
    "ship": ("tool", "gray", "on the sea", "sails to far lands"),
    "frog": ("animal", "green", "near the water", "jumps very high"),
}
NOUNS = sorted(THINGS)
PATTERN_WORDS = ["red", "blue", "green", "up", "down", "left", "right", "ping", "pong", "tick", "tock"]
SYSTEMS = {
    "plain": "You are a helpful assistant .",
    "think": "You are a careful assistant . Think step by step .",
    "brief": "Answer briefly .",
}
MAX_NUMBER = 99  # every number in the language is below 100, so each is one token


@dataclass
class Task:
    """One user request with the answer the language defines for it in each style."""

    prompt: str
    answer: str  # full answer (plain style)
    brief: str  # just the result
    thought: str = ""  # the reasoning a `think` system prompt asks for, if the task has one


def _words(xs) -> str:
    return " ".join(str(x) for x in xs)


def _count(rng: random.Random) -> Task:
    n = rng.randint(3, 60)
    if rng.random() < 0.5:
        a = rng.randint(0, MAX_NUMBER - n)
        seq = list(range(a, a + n + 1))
        prompt = f"Count up from {a} to {a + n} ."
        head = f"Sure . Counting up from {a} to {a + n} :"
    else:
        a = rng.randint(n, MAX_NUMBER)
        seq = list(range(a, a - n - 1, -1))
        prompt = f"Count down from {a} to {a - n} ."
        head = f"Sure . Counting down from {a} to {a - n} :"
    body = _words(seq)
    return Task(prompt, f"{head}\n{body}\nThat is {len(seq)} numbers .", body)


def _parity(rng: random.Random) -> Task:
    n = rng.randint(2, 24)
    a = rng.randint(0, MAX_NUMBER - n)
    lines = [f"{x} is {'even' if x % 2 == 0 else 'odd'} ." for x in range(a, a + n + 1)]
    prompt = f"Say if each number from {a} to {a + n} is even or odd ."
    evens = sum(1 for x in range(a, a + n + 1) if x % 2 == 0)
    answer = "Here is the list :\n" + "\n".join(lines) + f"\nSo {evens} of them are even ."
    return Task(prompt, answer, "\n".join(lines))


def _reverse(rng: random.Random) -> Task:
    words = rng.choices(NOUNS, k=rng.randint(3, 16))
    prompt = f"Reverse these words : {_words(words)} ."
    body = _words(reversed(words))
    return Task(prompt, f"The words in reverse order are :\n{body} .", f"{body} .")


def _sort(rng: random.Random) -> Task:
    xs = [rng.randint(0, MAX_NUMBER) for _ in range(rng.randint(3, 10))]
    prompt = f"Sort these numbers : {_words(xs)} ."
    body = _words(sorted(xs))
    thought = f"The smallest is {min(xs)} and the largest is {max(xs)} ."
    return Task(prompt, f"From smallest to largest :\n{body} .", f"{body} .", thought)


def _sum(rng: random.Random) -> Task:
    if rng.random() < 0.5:
        a = rng.randint(0, MAX_NUMBER)
        b = rng.randint(0, MAX_NUMBER - a)
        op, c = "+", a + b
        thought = f"{a} + {b - b % 10} = {a + b - b % 10} . Then {a + b - b % 10} + {b % 10} = {c} ."
    else:
        a = rng.randint(0, MAX_NUMBER)
        b = rng.randint(0, a)
        op, c = "-", a - b
        thought = f"{a} - {b - b % 10} = {a - b + b % 10} . Then {a - b + b % 10} - {b % 10} = {c} ."
    prompt = f"What is {a} {op} {b} ?"
    return Task(prompt, f"{a} {op} {b} = {c} . The answer is {c} .", f"{c}", thought)


def _repeat(rng: random.Random) -> Task:
    pattern = rng.sample(PATTERN_WORDS, rng.randint(2, 3))
    k = rng.randint(2, 16)
    prompt = f"Repeat {_words(pattern)} {k} times ."
    body = _words(pattern * k)
    return Task(prompt, f"Here it is :\n{body}", body)


def _describe(rng: random.Random) -> Task:
    n = rng.choice(NOUNS)
    kind, colour, where, does = THINGS[n]
    prompt = f"Tell me about the {n} ."
    answer = (
        f"The {n} is a kind of {kind} . It is often {colour} and you can find it {where} . "
        f"A {n} {does} . In short , the {n} is a {colour} {kind} ."
    )
    return Task(prompt, answer, f"A {colour} {kind} {where} .")


def _story(rng: random.Random) -> Task:
    a, b = rng.sample(NOUNS, 2)
    k = rng.randint(2, 6)
    (_, ca, wa, da), (kb, cb, wb, _) = THINGS[a], THINGS[b]
    sentences = [
        f"Once upon a time there was a {ca} {a} {wa} .",
        f"Every day the {a} {da} .",
        f"One morning the {a} met a {cb} {b} that lived {wb} .",
        f"The {b} said : I am a {kb} and I live {wb} .",
        f"So the {a} and the {b} became friends .",
        f"And the {a} still {da} , with the {b} close by .",
    ][:k - 1] + ["The end ."]
    prompt = f"Tell a story about a {a} and a {b} in {k} sentences ."
    return Task(prompt, " ".join(sentences), " ".join(sentences[:2]))


TASKS = [_count, _parity, _reverse, _sort, _sum, _repeat, _describe, _story]
FOLLOW_UPS = ["Do it again .", "Thank you .", "Now in reverse ."]


def _reply(task: Task, style: str) -> str:
    if style == "brief":
        return task.brief
    if style == "think" and task.thought:
        return f"{THINK_OPEN} {task.thought} {THINK_CLOSE}\n{task.answer}"
    return task.answer


def _follow_up(kind: str, previous: str) -> str:
    """The answer to a follow-up turn, a function of the previous answer."""
    if kind == "Do it again .":
        return previous
    if kind == "Thank you .":
        return "You are welcome ."
    visible = previous.split(THINK_CLOSE)[-1].strip()
    return "Reversed :\n" + _words(reversed(visible.split()))


def make_conversation(rng: random.Random) -> list[dict]:
    """One conversation of the demo language, with the answers the language defines."""
    style = rng.choice(["none", "none", "plain", "think", "brief"])
    messages = [] if style == "none" else [{"role": "system", "content": SYSTEMS[style]}]
    turns = rng.choices([1, 2, 3], weights=[6, 3, 1])[0]
    previous = None
    for _ in range(turns):
        if previous is not None and rng.random() < 0.4:
            prompt = rng.choice(FOLLOW_UPS)
            answer = _follow_up(prompt, previous)
        else:
            task = rng.choice(TASKS)(rng)
            prompt, answer = task.prompt, _reply(task, style)
        messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        previous = answer
    return messages


def make_prompts(n: int, seed: int) -> list[dict]:
    """The bundled prompt set: conversations in the `messages` form. About half keep their
    reference assistant turns (as a chat dataset does), the rest end at the last user turn."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        messages = make_conversation(rng)
        if rng.random() < 0.5:
            messages = messages[:-1]
        rows.append({"messages": messages})
    return rows


def build_tokenizer(texts: list[str]):
    """Word-level tokenizer over GPT-2 style byte-level pieces: every word, number and
    punctuation mark of the language is one token, and decoding restores the text exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = [PAD, IM_START, IM_END, UNK]
    trainer = trainers.WordLevelTrainer(special_tokens=specials, min_frequency=1)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens([THINK_OPEN, THINK_CLOSE])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=PAD, unk_token=UNK,
        additional_special_tokens=[IM_START, IM_END], model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"  # generation pads on the left
    return fast


def portable_tokenizer_config(path: Path) -> None:
    """Write the tokenizer config with the names transformers 4.x also reads (5.x saves its own
    `TokenizersBackend` class and a list-valued `extra_special_tokens`, which 4.x rejects)."""
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["additional_special_tokens"] = config.pop("extra_special_tokens", [])
    path.write_text(json.dumps(config, indent=2) + "\n")


def render(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The chat template, in Python, for training (the tokenizer carries the same as Jinja)."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def encode_for_training(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of a rendered conversation and a 0/1 mask of the tokens to learn: the
    assistant contents and their closing `<|im_end|>` (so the model learns to stop)."""
    ids, mask = [], []
    for m in messages:
        head = tokenizer.encode(f"{IM_START}{m['role']}\n", add_special_tokens=False)
        body = tokenizer.encode(m["content"] + IM_END, add_special_tokens=False)
        tail = tokenizer.encode("\n", add_special_tokens=False)
        learn = int(m["role"] == "assistant")
        ids += head + body + tail
        mask += [0] * len(head) + [learn] * len(body) + [0] * len(tail)
    return ids, mask


def target_config(vocab_size: int, tokenizer):
    """Qwen3 shapes the drafter can copy: GQA (2 query heads, 1 kv head), head_dim 64, 6 layers.
    The embedding is padded to a multiple of 64 with at least one spare row, where the drafter
    puts its `<|MASK|>` token (as Qwen3's padded table does)."""
    from transformers import Qwen3Config

    padded = (vocab_size // 64 + 1) * 64
    return Qwen3Config(
        vocab_size=padded, hidden_size=128, intermediate_size=384, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
        rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD),
        bos_token_id=None, architectures=["Qwen3ForCausalLM"],
    )


def _batches(lengths: list[int], token_budget: int, rng: random.Random) -> list[list[int]]:
    """Index batches of similar length (padded size <= token_budget), in shuffled order."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[i] > token_budget:
            batches.append(cur)
            cur = []
        cur.append(i)
    batches.append(cur)
    rng.shuffle(batches)
    return batches


def train_target(tokenizer, conversations: list[list[dict]], *, steps: int, seed: int,
                 lr: float = 3e-3, token_budget: int = 4096):
    """Train the tiny target on the assistant tokens of `conversations`; returns the model."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = AutoModelForCausalLM.from_config(target_config(len(tokenizer), tokenizer), dtype=torch.float32)
    encoded = [encode_for_training(tokenizer, c) for c in conversations]
    batches = _batches([len(ids) for ids, _ in encoded], token_budget, rng)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    pad = tokenizer.pad_token_id
    model.train()
    bar = tqdm(range(steps), desc="train target", unit="step")
    for step in bar:
        idx = batches[step % len(batches)]
        width = max(len(encoded[i][0]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        labels = torch.full((len(idx), width), -100, dtype=torch.long)
        attn = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            x, m = encoded[i]
            ids[r, : len(x)] = torch.tensor(x)
            attn[r, : len(x)] = 1
            labels[r, : len(x)] = torch.where(torch.tensor(m, dtype=torch.bool), torch.tensor(x), -100)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")  # sync point, only every 10 steps
    model.eval()
    return model


def build(out: Path, *, seed: int = 0, n_train: int = 20000, n_prompts: int = 1000, steps: int = 300,
          batch_size: int = 16, max_new_tokens: int = 256, threads: int = 2, log=print) -> dict:
    """Re-create the demo assets in `out`: target/, prompts.jsonl, demo_data.jsonl."""
    import torch

    from dflash.regenerate import RegenerateConfig, regenerate

    torch.set_num_threads(threads)
    out = Path(out)
    (out / "target").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rng = random.Random(seed)
    train = [make_conversation(rng) for _ in range(n_train)]
    texts = [m["content"].replace(THINK_OPEN, "").replace(THINK_CLOSE, "") for c in train for m in c]
    tokenizer = build_tokenizer(texts + ["system", "user", "assistant"])
    log(f"tokenizer: {len(tokenizer)} tokens")
    model = train_target(tokenizer, train, steps=steps, seed=seed)
    model.generation_config.do_sample = False
    # bf16 halves the bundle; regeneration below reads these rounded weights, so the dataset is
    # what the saved target produces
    model.to(torch.bfloat16).save_pretrained(out / "target")
    tokenizer.save_pretrained(out / "target")
    portable_tokenizer_config(out / "target" / "tokenizer_config.json")
    prompts = make_prompts(n_prompts, seed + 1)
    with (out / "prompts.jsonl").open("w", encoding="utf-8") as f:
        for row in prompts:
            f.write(json.dumps(row) + "\n")
    data = out / "demo_data.jsonl"
    data.unlink(missing_ok=True)
    t1 = time.perf_counter()
    stats = regenerate(RegenerateConfig(
        target=str(out / "target"), input=str(out / "prompts.jsonl"), output=str(data),
        max_new_tokens=max_new_tokens, batch_size=batch_size, keep_thinking=True, backend="hf",
        target_name="dflash-demo-target", dtype="float32",
    ))
    t2 = time.perf_counter()
    log(f"built in {t2 - t0:.0f}s (training and setup {t1 - t0:.0f}s, regeneration {t2 - t1:.0f}s)")
    return {"train_s": t1 - t0, "regen_s": t2 - t1, **stats}
