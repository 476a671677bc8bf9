"""reconstruct/files.py: atomic writes, and writes that never replace a file (issue 37)."""

import errno
import os

import pytest

from reconstruct.files import write_atomic


def test_write_atomic_replaces_by_default_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "sub" / "f.jsonl"
    write_atomic(path, b"one\n")
    write_atomic(path, lambda tmp: tmp.write_bytes(b"two\n"))
    assert path.read_bytes() == b"two\n"
    assert [p.name for p in path.parent.iterdir()] == ["f.jsonl"]


@pytest.mark.parametrize("links", [True, False], ids=["hard-links", "no-hard-links"])
def test_issue37_write_atomic_without_replace_never_replaces(tmp_path, monkeypatch, links):
    if not links:  # a file system without hard links (EPERM from link(2)): the name is taken with O_EXCL instead

        def link(src, dst):
            raise OSError(errno.EPERM, "Operation not permitted")

        monkeypatch.setattr(os, "link", link)
    path = tmp_path / "f.jsonl"
    write_atomic(path, b"mine\n", replace=False)
    assert path.read_bytes() == b"mine\n"
    with pytest.raises(FileExistsError):
        write_atomic(path, b"again\n", replace=False)
    other = tmp_path / "g.jsonl"

    def meanwhile(tmp):  # someone makes the file while this one is being written
        other.write_bytes(b"theirs\n")
        tmp.write_bytes(b"mine\n")

    with pytest.raises(FileExistsError):
        write_atomic(other, meanwhile, replace=False)
    assert path.read_bytes() == b"mine\n" and other.read_bytes() == b"theirs\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.jsonl", "g.jsonl"]


def test_write_atomic_without_replace_raises_other_link_errors(tmp_path, monkeypatch):
    def link(src, dst):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "link", link)
    with pytest.raises(OSError, match="Input/output error"):
        write_atomic(tmp_path / "f.jsonl", b"x\n", replace=False)
    assert list(tmp_path.iterdir()) == []
