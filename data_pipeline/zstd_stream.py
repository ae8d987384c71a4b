"""Reading a .zst corpus file as a stream, in bounded memory, noticing a file cut off inside a frame.

zstandard's stream_reader reads across frames into the caller's buffer (memory is that buffer, however well a long
line compresses: its decompressobj hands back all the output of an input chunk at once, 260 MiB for a 256 MiB line
of 8 KB compressed), but ends quietly at a cut-off frame, which would silently drop the rest of a corpus file. So at
its end the frames are walked, headers only (`check_frames`), and input ending inside a frame raises EOFError.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import BinaryIO

from pretrain.core.errors import DataError

_FRAME = 0xFD2FB528
_SKIPPABLE = 0x184D2A50  # ..5F: the low 4 bits are free


def open_zstd(path: Path, buffer_size: int) -> BinaryIO:
    """`path` decompressed, with readline(limit) (a BufferedReader of `buffer_size` over the raw stream)."""
    try:
        import zstandard
    except ImportError:
        raise DataError(f"{path}: reading .zst needs the 'zstandard' package (pip install zstandard)") from None
    return io.BufferedReader(_ZstdRaw(path, zstandard), buffer_size)


class _ZstdRaw(io.RawIOBase):
    """zstandard's stream_reader across frames, and the frame walk once it has ended."""

    def __init__(self, path: Path, zstandard):
        super().__init__()
        self._path = path
        self._file = open(path, "rb")
        self._reader = zstandard.ZstdDecompressor().stream_reader(
            self._file, read_size=1 << 17, read_across_frames=True, closefd=False
        )
        self._walked = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self._reader.readinto(buffer)
        if n == 0 and not self._walked:
            self._walked = True
            check_frames(self._path)
        return n

    def close(self) -> None:
        self._reader.close()
        self._file.close()
        super().close()


def check_frames(path: Path) -> None:
    """Raise EOFError where `path` ends inside a zstd frame (what is not a frame is left to the decompressor)."""
    size = path.stat().st_size
    with open(path, "rb", buffering=0) as f:
        start = 0
        while start < size:
            end = _frame_end(f.fileno(), start)
            if end is None:
                return
            if end > size:
                raise _cut(start)
            start = end


def _frame_end(fd: int, start: int) -> int | None:
    """Where the frame at `start` ends, from its headers alone (RFC 8878): a frame's header, then each block's 3-byte
    header and a jump past its content, to the block flagged last and the optional checksum; a skippable frame says
    its own size. Past the file's end where it is cut; None for what is not a frame."""

    def read(pos: int, n: int) -> int:
        got = os.pread(fd, n, pos)
        if len(got) < n:
            raise _cut(start)
        return int.from_bytes(got, "little")

    magic = read(start, 4)
    if magic & ~0xF == _SKIPPABLE:
        return start + 8 + read(start + 4, 4)
    if magic != _FRAME:
        return None
    descriptor = read(start + 4, 1)
    single_segment = descriptor >> 5 & 1
    content_size_bytes = (single_segment, 2, 4, 8)[descriptor >> 6]
    end = start + 5 + (not single_segment) + (0, 1, 2, 4)[descriptor & 3] + content_size_bytes
    last = False
    while not last:
        block = read(end, 3)  # bit 0: last block; bits 1-2: type (1: RLE, one byte); then its size
        last = bool(block & 1)
        end += 3 + (1 if block >> 1 & 3 == 1 else block >> 3)
    return end + 4 * (descriptor >> 2 & 1)  # the content checksum


def _cut(start: int) -> EOFError:
    return EOFError(f"compressed data ends inside the zstd frame that starts at byte {start}")
