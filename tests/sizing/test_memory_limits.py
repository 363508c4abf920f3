"""The memory plan's limits hold as a user reads them: the price of a micro-batch grows with its rows
(a row budget bounds every micro-batch under it), a refusal's every suggestion passes, and a huge
--gpu-memory-gib is refused by argparse while the table's columns never run together."""
import re

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dflash.demo import TARGET
from dflash.errors import UserError
from dflash.sizing.memory import MemorySetup, plan_for
from dflash.target.spec import load_target_spec
from dflash.tools import plan_memory
from dflash.training.config import load_config
from dflash.training.plan import plan_run, resolve_run

# a large target, and the demo's tiny one whose drafter the CPU trains (with the reference attention)
SPECS = {"qwen3-8b": load_target_spec("qwen3-8b", bare_presets=True), "demo": load_target_spec(str(TARGET))}


@settings(max_examples=150, deadline=None)
@example(target="demo", attention="reference", checkpointing=False, dtype_bytes=4, draft_layers=5, block_size=16,
         tokens=2048, rows=[16384, 32000], features=5)  # the case the issue found
@given(target=st.sampled_from(sorted(SPECS)), attention=st.sampled_from(["reference", "kernel"]),
       checkpointing=st.booleans(),
       dtype_bytes=st.sampled_from([2, 4]), draft_layers=st.integers(1, 6), block_size=st.sampled_from([8, 16]),
       tokens=st.integers(1, 1 << 17), rows=st.lists(st.integers(0, 1 << 18), min_size=2, max_size=2),
       features=st.integers(1, 5))
def test_the_memory_plan_grows_with_the_rows(target, attention, checkpointing, dtype_bytes, draft_layers, block_size,
                                             tokens, rows, features):
    """The CPU's reference attention runs in chunks past a number of scores and holds less there: the
    plan priced 16,000 rows below 8,192 and refused a run "needing 0.69 GiB of 0.85 usable"."""
    setup = MemorySetup(dtype_bytes=dtype_bytes, attention=attention, activation_checkpointing=checkpointing,
                        block_size=block_size, num_anchors=64)
    plan = plan_for(SPECS[target], setup, draft_layers=draft_layers, features=features)
    fewer, more = sorted(rows)
    assert plan.peak(tokens, fewer)["total"] <= plan.peak(tokens, more)["total"]


@pytest.fixture(scope="module")
def demo_store(tmp_path_factory):
    from dflash.data import prepare_jsonl
    from dflash.demo import DATA

    return prepare_jsonl(DATA, TARGET, tmp_path_factory.mktemp("demo") / "store", progress=False).output


@pytest.mark.parametrize("data, anchors, gib", [
    pytest.param("conversations", "1000", "3", id="conversations"),
    pytest.param("store", "1000", "3", id="store"),
    # a token budget that fits the memory was suggested below the store's longest sample (839 tokens)
    pytest.param("store", "128", "2.8", id="store, a budget under its longest sample"),
])
def test_a_refusal_sizes_what_it_prices_and_every_suggestion_passes(data, anchors, gib, request):
    """`--num-anchors 1000 --memory-gib 3` on the CPU: the refusal's figure is above what is usable,
    and each flag it suggests, applied alone, gives a run the plan accepts and whose samples the
    token budget holds (a store's samples are not cut: a budget below its longest was refused)."""
    from dflash.data.planner import check_lengths
    from dflash.data.token_store import TokenStore

    base = ["--num-anchors", anchors, "--memory-gib", gib, "--token-budget", "2048"]  # the demo's budget
    if data == "store":
        base += ["--data", str(request.getfixturevalue("demo_store"))]
    cfg = load_config(base)
    spec = load_target_spec(cfg.inputs.target)
    with pytest.raises(UserError) as err:
        plan_run(resolve_run(cfg, spec), device=torch.device("cpu"), world_size=1)
    text = str(err.value)
    needs, usable = (float(x) for x in re.search(r"needs about ([\d.]+) GiB per rank, more than the ([\d.]+) GiB "
                                                 r"usable", text).groups())
    assert needs > usable, text
    ways = re.search(r"\nit would fit with: (.*)\n", text).group(1).split("; or ")
    assert ways, text
    for way in ways:
        flags = re.match(r"(--[\w-]+)(?: ([\w./,]+))?", way).groups()
        args = [flags[0]] + ([flags[1].replace(",", "")] if flags[1] else [])
        if "--deepspeed_config" in args:
            continue  # ZeRO-3 on one CPU rank is refused by the trainer's own checks for other reasons
        plan = plan_run(resolve_run(load_config([*base, *args]), spec), device=torch.device("cpu"), world_size=1)
        assert plan.cfg.batches.row_budget >= plan.memory.min_rows(), way
        if data == "store":
            check_lengths(TokenStore(cfg.inputs.data).lengths, plan.cfg.batches.token_budget, name=str)


def test_a_refusal_that_no_one_flag_answers_lists_two_that_do():
    """A Qwen3-8B on one 66 GiB rank: no one flag is enough, and the refusal named the anchor ceiling
    alone (round 4's "it would fit with: ..." had slipped); now it lists changes made together, and
    each gives a run the plan accepts."""
    base = ["--target", "random:qwen3-8b", "--memory-gib", "66"]
    spec = load_target_spec("random:qwen3-8b")
    with pytest.raises(UserError) as err:
        plan_run(resolve_run(load_config(base), spec), device=torch.device("cpu"), world_size=1)
    ways = re.search(r"\nit would fit with: (.*)\n", str(err.value)).group(1).split("; or ")
    assert "--activation-checkpointing --num-anchors 256" in ways, ways
    for way in ways:
        args = [a.replace(",", "") for a in way.split()]
        if "--deepspeed_config" in args:
            continue  # ZeRO-3 on one CPU rank is refused by the trainer's own checks for other reasons
        plan = plan_run(resolve_run(load_config([*base, *args]), spec), device=torch.device("cpu"), world_size=1)
        assert plan.cfg.batches.row_budget >= plan.memory.min_rows(), way


def test_plan_memory_refuses_huge_memory_and_keeps_its_columns_apart(capsys):
    with pytest.raises(SystemExit) as e:
        plan_memory.main(["--gpu-memory-gib", "1e300"])
    assert e.value.code == 2
    assert "--gpu-memory-gib: must be in [0, 65536] GiB (0: the GPU's own), got 1e+300" in capsys.readouterr().err
    plan_memory.main(["--gpu-memory-gib", "65536", "--token-budget", "1"])
    lines = capsys.readouterr().out.splitlines()
    for head in ("target  ", "target  "):
        start = lines.index(next(line for line in lines if line.startswith(head)))
        rows = [lines[start]] + [line for line in lines[start + 1:start + 5] if line and not line.startswith("-")]
        cells = [line.split("  ") for line in rows]
        widths = {len([c for c in cell if c]) for cell in cells}
        assert len(widths) == 1, rows  # every row has as many cells as the header
        del lines[:start + 1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="0 plans for this machine's GPU")
def test_plan_memory_names_the_option_as_typed_and_means_by_0_what_train_does(capsys):
    """`--gpu-memory-gib -1` used to be refused naming --memory-gib, a name not typed; 0 was allowed by
    the range ("0: the GPU's own") and refused by the script ("must be positive"). 36 layers hold no
    100 taps: planned all the same."""
    cases = {("--gpu-memory-gib", "-1"): "--gpu-memory-gib: must be in [0, 65536] GiB (0: the GPU's own), got -1.0",
             ("--memory-gib", "-1"): "--memory-gib: must be in [0, 65536] GiB (0: the GPU's own), got -1.0",
             ("--gpu-memory-gib", "0"): "--gpu-memory-gib 0: 0 is the GPU's own memory, and this machine has no GPU; "
                                        "give the memory per GPU in GiB",
             ("--memory-gib", "0"): "--memory-gib 0: 0 is the GPU's own memory, and this machine has no GPU; give "
                                    "the memory per GPU in GiB",
             ("--num-target-features", "100"): "--num-target-features 100: the target has 36 layers, and the tap "
                                               "rule spreads at most 33 distinct taps over them (layers 1 to L-3); "
                                               "give fewer"}
    for argv, said in cases.items():
        with pytest.raises(SystemExit):
            plan_memory.main(["--target", "qwen3-8b", *argv])
        assert capsys.readouterr().err == f"error: {said}\n"
    plan_memory.main(["--target", "qwen3-8b", "--num-target-features", "33"])  # the most there is room for
    assert "peak/GPU" in capsys.readouterr().out


def test_an_allocation_failure_is_known_on_every_device():
    """The CPU's allocator raises a plain RuntimeError: the trainer's out-of-memory line (and its
    --resume hint) used to show for CUDA's torch.OutOfMemoryError alone."""
    from dflash.errors import allocation_failed

    with pytest.raises(RuntimeError) as cpu:
        torch.empty(1 << 62, dtype=torch.uint8)
    assert allocation_failed(cpu.value) and not isinstance(cpu.value, torch.OutOfMemoryError)
    assert allocation_failed(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"))
    assert not allocation_failed(RuntimeError("Expected all tensors to be on the same device"))
    assert not allocation_failed(ValueError("out of memory"))  # only what an allocation raises
