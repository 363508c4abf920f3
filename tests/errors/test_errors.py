"""One-line errors (`dflash.errors`): a command's UserError or a fault of the environment is one
`error:` line and status 2; anything else is raised as it was."""
import errno
import signal

import pytest

from dflash.errors import UserError, disk_full, environment_error, exit_on_user_error


@pytest.fixture
def signals_kept():
    """exit_with_error takes SIGINT and SIGTERM for the exiting process: the test session's back after."""
    kept = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in kept.items():
        signal.signal(s, handler)


def failing(err):
    @exit_on_user_error
    def main():
        raise err

    return main


@pytest.mark.parametrize("err, line", [
    (UserError("--data x: no such file"), "error: --data x: no such file\n"),
    (OSError(errno.EROFS, "Read-only file system", "/out/f"), "error: /out/f: read-only file system\n"),
])
def test_a_user_error_or_a_fault_of_the_environment_is_one_line_and_status_2(err, line, capsys, signals_kept):
    with pytest.raises(SystemExit) as e:
        failing(err)()
    assert e.value.code == 2
    assert capsys.readouterr().err == line


def test_any_other_error_is_raised_as_it_was(signals_kept):
    with pytest.raises(KeyError, match="bug"):
        failing(KeyError("bug"))()


def test_a_full_disk_is_found_behind_what_it_caused():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("save failed") from inner
    except RuntimeError as outer:
        assert disk_full(outer)
        assert "the disk is full" in environment_error(outer) and "free some space" in environment_error(outer)
    assert not disk_full(RuntimeError("shape mismatch")) and environment_error(ValueError("x")) is None
