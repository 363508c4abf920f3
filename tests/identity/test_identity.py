"""What a file is, by its content (`dflash.identity`): a record matches the file until its bytes change."""
import hashlib

from dflash.identity import file_identity, same_file, sha256_file


def test_the_hash_is_the_files_sha256(tmp_path):
    path = tmp_path / "w.bin"
    data = bytes(range(256)) * 5000  # more than one read's chunk
    path.write_bytes(data)
    assert sha256_file(path) == hashlib.sha256(data).hexdigest()


def test_a_record_matches_its_file_until_the_content_changes(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(b"abcd")
    recorded = file_identity(path)
    assert recorded["size"] == 4 and same_file(recorded, path)
    path.write_bytes(b"abce")  # same size, other bytes: found by hashing
    assert not same_file(recorded, path)
    path.write_bytes(b"abcde")
    assert not same_file(recorded, path)
    path.unlink()
    assert not same_file(recorded, path)
