"""A write that fails part-way (a full disk, a file-size limit) ends in one error line naming what was being written,
leaves what was done before as it was, and the same command again, once there is room, finishes the work."""

from __future__ import annotations

import errno
import os

import pytest

from pretrain.core.outputs import claim_output, mark_output

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_marker_that_could_not_be_written_leaves_the_directory_claimable(tmp_path, monkeypatch):
    """The output marker went through a temporary file that a failed write left behind: not a name of ours, so the
    same command again, with space, refused the directory it had created itself ('files this tool did not write')."""
    out = tmp_path / "shards"

    def no_room(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patched:
        patched.setattr(os, "replace", no_room)
        with pytest.raises(OSError):
            mark_output(out, "shards")
    assert list(out.iterdir()) == []
    claim_output(out, "shards")  # the same command again may write there
    mark_output(out, "shards")
    assert [p.name for p in out.iterdir()] == [".bert-pretrain.json"]
