"""Writers' outputs (`dflash.partial`): a file is replaced all or nothing, and one writer holds an output."""
import pytest

from dflash.errors import UserError
from dflash.partial import OutputLock, replace_file


def test_a_failed_replacement_leaves_the_file_as_it_was_and_no_temporary(tmp_path):
    path = tmp_path / "out.json"
    path.write_bytes(b"old")

    def chunks():
        yield b"new, half written"
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError) as e:
        replace_file(path, chunks())
    assert e.value.filename == str(path)  # named by the file being written
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["out.json"]
    replace_file(path, [b"new", b" whole"])
    assert path.read_bytes() == b"new whole" and [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_a_second_writer_of_one_output_is_refused_until_the_first_ends(tmp_path):
    out = tmp_path / "store"
    with OutputLock(out, what="preparation"):
        with pytest.raises(UserError, match=r"--output .*store: another preparation is writing it \(process \d+@"):
            with OutputLock(out, what="preparation"):
                pass
    with OutputLock(out):  # free again, and its lock file gone
        pass
    assert not (tmp_path / ".store.lock").exists()
