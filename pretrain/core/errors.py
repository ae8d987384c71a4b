"""Errors meant for the person at the keyboard.

A `UserError` is printed by the CLI as one line (no traceback): it must name the file, line, key or
value that is wrong. Anything else that escapes is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input from the user: a path, a config key or value, a corrupt file."""


class DataError(UserError):
    """A corpus, shard or manifest that cannot be used as it is."""


class ConfigError(UserError):
    """A config key or value that is unknown, of the wrong type, or inconsistent."""
