"""Python processes for the tests, forked from one that has already imported torch, transformers
and DeepSpeed.

A rank of a 2-rank CPU run spends about 8 s of CPU importing those three (two ranks on two cores:
most of a tiny launch); forked from a server that imported them once, a rank starts in a fraction
of a second. What each process runs is what `python -u SCRIPT ARGS` would run: its own environment,
working directory, `sys.argv`, `sys.path`, stdout and stderr (files), a session of its own, its
exit status and its exit handlers. What differs: the third-party modules were imported before its
environment was set (the server imports them with the ranks' CPU settings), and the interpreter's
final teardown does not run; a test about interpreter shutdown starts a fresh interpreter.
"""
import atexit
import contextlib
import functools
import io
import json
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import signal
import subprocess
import sys
import tempfile

# heavy third-party modules a training rank imports (dflash itself is imported per process, after
# its environment is set, as the code under test); DeepSpeed's engine imports its Muon module, whose
# torch.compile decorators import inductor, in every rank; then the metrics' TensorBoard writer,
# DeepSpeed's expert-parallel presets and datasets' generator reader (another 300 modules a run
# imports). Last, `tests.preload_frozen` moves all of it out of the collector's sight.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.tensor", "triton", "numpy",
           "safetensors.torch", "transformers", "transformers.masking_utils", "transformers.activations",
           "transformers.models.qwen3.modeling_qwen3", "deepspeed", "deepspeed.runtime.engine",
           "deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.module_inject.auto_ep_layer", "datasets",
           "datasets.io.generator", "matplotlib.pyplot", "torch.utils.tensorboard", "tests.preload_frozen"]
# what the server imports under: the settings every rank of the tests runs with
SERVER_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@functools.cache
def _context():
    """The fork server, started once per test session with PRELOAD imported."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    saved = dict(os.environ)
    os.environ.update(SERVER_ENV)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return ctx


@functools.cache
def _default_path() -> tuple[str, ...]:
    """`sys.path` of a fresh interpreter, less its script directory and PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                         capture_output=True, text=True, env=env, check=True).stdout
    return tuple(json.loads(out))


def _run(script: str, argv: list[str], env: dict, cwd: str, stdout: str, stderr: str, path: list[str]):
    """In the forked process: become `python -u script argv` and exit as it would."""
    os.setsid()  # its own process group: a timeout kills it and whatever it started
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if env.get("OMP_NUM_THREADS", "1") != "1":  # the server's OpenMP read 1 when torch loaded
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    for fd, name in ((1, stdout), (2, stderr)):
        f = os.open(name, os.O_WRONLY | os.O_APPEND)
        os.dup2(f, fd)
        os.close(f)
    sys.stdin = open(os.devnull)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
    sys.argv = [script, *argv]
    sys.path[:] = path
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code
    except BaseException as e:
        tb = e.__traceback__  # from the script's own frame on, as the interpreter prints it
        while tb is not None and tb.tb_frame.f_code.co_filename != script:
            tb = tb.tb_next
        e.with_traceback(tb or e.__traceback__)  # the hook prints the exception's own traceback
        sys.excepthook(type(e), e, e.__traceback__)
        code = 1
    atexit._run_exitfuncs()
    sys.exit(code)  # read as the interpreter reads it: None 0, an int itself, anything else printed and 1


class Process:
    """A started `python -u SCRIPT ARGS` with the Popen calls the tests use: `poll`, `wait`,
    `terminate`, `kill_group`, and its stdout and stderr once it has ended."""

    def __init__(self, script, args, env, cwd, stdout, stderr):
        env = {k: str(v) for k, v in env.items()}
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        path = [os.path.dirname(os.path.abspath(script)), *extra, *_default_path()]
        self.args, self.stdout, self.stderr = [str(script), *map(str, args)], stdout, stderr
        self._process = _context().Process(target=_run, args=(self.args[0], self.args[1:], env, str(cwd), stdout,
                                                              stderr, path))
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self):
        return self._process.exitcode

    def poll(self):
        return self._process.exitcode

    def wait(self, timeout=None):
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def terminate(self):
        self._process.terminate()

    def kill_group(self):
        with contextlib.suppress(ProcessLookupError):  # the group exists once the process has called setsid
            os.killpg(self.pid, signal.SIGKILL)
        self._process.kill()
        self._process.join()


def run(script, args, env=None, cwd=None, timeout=600) -> subprocess.CompletedProcess:
    """`subprocess.run([python, script, *args], capture_output=True, text=True, ...)`, preloaded; by
    default in the tests' environment with the ranks' CPU settings, in the current folder."""
    env = {**os.environ, **SERVER_ENV} if env is None else env
    with tempfile.TemporaryDirectory() as logs:
        out, err = os.path.join(logs, "out"), os.path.join(logs, "err")
        open(out, "w").close(), open(err, "w").close()
        process = Process(script, args, env, cwd or os.getcwd(), out, err)
        try:
            code = process.wait(timeout)
        except BaseException:
            process.kill_group()
            raise
        return subprocess.CompletedProcess(process.args, code, open(out).read(), open(err).read())
