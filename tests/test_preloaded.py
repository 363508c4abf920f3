"""tests/preloaded.py against a fresh interpreter: the same script, arguments and environment give
the same stdout, stderr and exit status."""
import json
import os
import subprocess
import sys

import pytest

from . import preloaded

SCRIPT = """
import json, os, sys
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "var": os.environ.get("PRELOAD_VAR"),
                  "main": __name__, "in_path": os.environ["EXTRA"] in sys.path}))
print("to stderr", file=sys.stderr)
how = sys.argv[1]
if how == "code":
    sys.exit(3)
if how == "message":
    sys.exit("error: a one-line refusal")
if how == "raise":
    raise RuntimeError("boom")
import atexit
atexit.register(lambda: print("exit handler ran", flush=True))
"""


@pytest.mark.parametrize("how", ["ok", "code", "message", "raise"])
def test_a_preloaded_process_runs_a_script_as_a_fresh_interpreter_does(tmp_path, how):
    script, extra = tmp_path / "scripts" / "s.py", tmp_path / "extra"
    script.parent.mkdir(), extra.mkdir()
    script.write_text(SCRIPT)
    env = {**os.environ, "PRELOAD_VAR": "set", "EXTRA": str(extra), "PYTHONPATH": str(extra)}
    fresh = subprocess.run([sys.executable, "-u", str(script), how, "x y"], capture_output=True, text=True, env=env,
                           cwd=tmp_path, timeout=60)
    forked = preloaded.run(script, [how, "x y"], env=env, cwd=tmp_path, timeout=60)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.returncode == {"ok": 0, "code": 3, "message": 1, "raise": 1}[how]
    assert ("exit handler ran" in fresh.stdout) == (how == "ok")


def test_a_timeout_kills_the_process_and_what_it_started(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import subprocess, sys, time\n"
                      "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                      "print(child.pid, flush=True)\ntime.sleep(60)\n")
    out = tmp_path / "out"
    out.write_text(""), (tmp_path / "err").write_text("")
    process = preloaded.Process(script, [], dict(os.environ), tmp_path, str(out), str(tmp_path / "err"))
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=3)
    process.kill_group()
    child = int(out.read_text())
    assert process.returncode == -9
    with pytest.raises(ProcessLookupError):
        for _ in range(100):  # the killed child is reaped by init
            os.kill(child, 0)
            __import__("time").sleep(0.05)


def test_every_preloaded_module_is_imported_and_frozen_before_the_fork(tmp_path):
    """The fork server skips a module it cannot import without a word: each must be there."""
    script = tmp_path / "s.py"
    script.write_text("import gc, json, sys\n"
                      "print(json.dumps([sorted(sys.modules), gc.get_freeze_count()]))\n")
    modules, frozen = json.loads(preloaded.run(script, [], timeout=60).stdout)
    assert set(preloaded.PRELOAD) <= set(modules)
    assert frozen > 100_000  # the imported modules' objects, in the permanent generation
