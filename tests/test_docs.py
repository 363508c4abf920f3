"""Every example in README.md and docs/*.md runs as written, or is marked illustrative.

A fence names its language: ```python and ```bash blocks run here (Python in a fresh temporary
folder, as a newcomer pastes it; shell commands from a temporary folder too, `launch/` and
`.venv/bin/` standing for this checkout's); a block that needs GPUs, a downloaded model or hours
has an `<!-- illustrative -->` line just above it; ```text blocks are output, files and diagrams.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.distributed.ranks import free_port

from . import preloaded
from .conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"python", "bash"}
SHOWN = {"text"}
ILLUSTRATIVE = "<!-- illustrative -->"
FENCE = re.compile(r"^(\s*)```(.*)$")

# The README's two set-up commands, run otherwise than as written (and why):
DEMO = "bash launch/install.sh && .venv/bin/deepspeed launch/train.py"
TESTS = "bash launch/install.sh test && .venv/bin/python -m pytest"
# the demo's install is .ci/run's; its training runs here for one step (the whole demo takes minutes),
# the launcher on a free port (other runs on the machine may hold DeepSpeed's default)
DEMO_TINY = ["--max-steps", "1", "--eval-temperatures", "0", "--speculate-turns", "1", "--no-progress"]


def fenced_blocks(path: Path) -> list[dict]:
    """Every fenced block of `path`: its language, code (dedented), first line and whether it is marked."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = len(m.group(1)), m.group(2).strip()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        marked = i > 0 and lines[i - 1].strip() == ILLUSTRATIVE
        code = "\n".join(line[indent:] for line in lines[i + 1:end]) + "\n"
        blocks.append({"where": f"{path.relative_to(ROOT)}:{i + 1}", "lang": lang, "code": code, "marked": marked})
        i = end + 1
    return blocks


ALL = [b for path in DOCS for b in fenced_blocks(path)]
RUNNABLE = [b for b in ALL if b["lang"] in RUN and not b["marked"]]


def test_every_block_is_run_or_marked():
    bad = [f"{b['where']}: ```{b['lang']}" for b in ALL
           if b["lang"] not in RUN | SHOWN or (b["marked"] and b["lang"] not in RUN)]
    assert not bad, ("a fence must say ```python or ```bash (run by this test, or marked "
                     f"{ILLUSTRATIVE} on the line above) or ```text (output): {bad}")
    assert {b["where"].split(":")[0] for b in RUNNABLE} >= {"README.md", "docs/GUIDE.md"}


def test_no_placeholders():
    for path in DOCS:
        found = re.findall(r"\b[A-Z][A-Z0-9]*_[A-Z0-9_]+\b(?![./])", path.read_text())
        assert not [f for f in found if f.startswith(("DEMO_", "TODO", "TBD", "XXX"))], (path, found)


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PYTHONPATH")}
    return {**env, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _shell_line(line: str) -> list[str]:
    """One documented command, with `launch/` and `.venv/bin/` resolved in this checkout."""
    bin_dir = Path(sys.executable).parent
    words = []
    for word in shlex.split(line, comments=True):
        if word.startswith(".venv/bin/"):
            word = str(bin_dir / word.removeprefix(".venv/bin/"))
        elif word in ("python", "python3"):
            word = sys.executable
        elif word.startswith("launch/"):
            word = str(ROOT / word)
        words.append(word)
    return words


def _run(cmd, cwd, timeout):
    """`cmd` from `cwd`; `python SCRIPT ...` forked preloaded (`tests.preloaded`: what a fresh
    interpreter runs, less its imports)."""
    if cmd[0] == sys.executable and len(cmd) > 1 and cmd[1].endswith(".py"):
        proc = preloaded.run(cmd[1], cmd[2:], env=_env(), cwd=cwd, timeout=timeout)
    else:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=_env())
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.parametrize("block", [b for b in RUNNABLE if b["lang"] == "python"], ids=lambda b: b["where"])
def test_python_example_runs(block, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(block["code"])
    _run([sys.executable, str(script)], tmp_path, timeout=60)


@pytest.mark.parametrize("block", [b for b in RUNNABLE if b["lang"] == "bash"], ids=lambda b: b["where"])
def test_shell_example_runs(block, tmp_path):
    code = block["code"].replace("\\\n", " ").strip()
    if code == TESTS:  # the suite itself: it is what CI runs
        ci = [ln.split("#")[0].strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
        install, suite = TESTS.split(" && ")
        assert install in ci and ci[-1] == suite and ci.index(install) < len(ci) - 1
        return
    if code == DEMO:
        launcher, script = _shell_line(DEMO.split(" && ")[1])
        _run([launcher, "--master_port", str(free_port()), script, *DEMO_TINY], tmp_path, timeout=300)
        run = tmp_path / "runs" / "demo"  # where the README says, from the folder it ran in
        assert (run / "drafter" / "model.safetensors").is_file() and (run / "metrics.jsonl").is_file()
        assert (ROOT / "launch" / "install.sh").is_file()
        return
    for line in code.splitlines():
        _run(_shell_line(line), tmp_path, timeout=120)
