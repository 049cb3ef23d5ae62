"""Errors that reach the user as one line, without a traceback."""


class UserError(Exception):
    """Bad input from the user: the CLI prints `titan-async: <message>` and exits 2."""


class AgreedError(UserError):
    """A UserError that every rank of a run raises alike: only rank 0 prints it."""
