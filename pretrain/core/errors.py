"""Errors meant for the person at the keyboard.

A `UserError` is printed by the CLI as one line (no traceback): it must name the file, line, key or
value that is wrong. Anything else that escapes is a bug and keeps its traceback, but for a read or write the
user's system refused (`no_room`, `no_access`): one line too, naming the path.
"""

import errno
import re


class UserError(Exception):
    """Bad input from the user: a path, a config key or value, a corrupt file."""


class DataError(UserError):
    """A corpus, shard or manifest that cannot be used as it is."""


class ConfigError(UserError):
    """A config key or value that is unknown, of the wrong type, or inconsistent."""


# What a write that did not fit says, by errno, and what the user can do about it
NO_ROOM = {
    errno.ENOSPC: ("no space left on device", "free some space"),
    errno.EDQUOT: ("disk quota exceeded", "free some space (or have the quota raised)"),
    errno.EFBIG: (
        "file too large for the file system or the file-size limit (ulimit -f)",
        "raise the limit or write to another file system",
    ),
}


def io_errno(err: BaseException) -> int | None:
    """The errno of a failed read or write: an OSError's, or the one a Rust library (tokenizers' save, safetensors)
    leaves in the message of the plain exception it raises ('... (os error 28)', 'Os { code: 28, ...')."""
    if isinstance(err, OSError):
        return err.errno
    found = re.search(r"\(os error (\d+)\)|Os \{ code: (\d+)", str(err))
    return int(found.group(1) or found.group(2)) if found else None


def no_room(err: BaseException) -> str | None:
    """The one line for `err` where it says a write did not fit (NO_ROOM), else None."""
    code = io_errno(err)
    if code not in NO_ROOM:
        return None
    what, remedy = NO_ROOM[code]
    # a copy or a rename names its source first, and the file being written second (shutil.copy2's full disk)
    written = getattr(err, "filename2", None) or getattr(err, "filename", None)
    where = f" while writing {written}" if written else ""
    return f"{what}{where}; {remedy} and run the same command again (finished work is kept)"


# What a file the user's system does not let us write (or read) says, by errno: only where the error names the path
NO_ACCESS = {
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}


def no_access(err: BaseException) -> str | None:
    """The one line for `err` where it says a path may not be written or read (an output on a read-only mount, a
    directory of another user), else None."""
    path = getattr(err, "filename2", None) or getattr(err, "filename", None)
    if not isinstance(err, OSError) or err.errno not in NO_ACCESS or not path:
        return None
    return (
        f"{NO_ACCESS[err.errno]}: {path}; check its permissions or choose another path, and run the same command "
        "again (finished work is kept)"
    )
