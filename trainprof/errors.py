"""The error a user can fix (a path, a value, a combination): every entry point prints it as one line
on stderr and exits with code 2."""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix (a path, a value): printed as one line, exit code 2."""
