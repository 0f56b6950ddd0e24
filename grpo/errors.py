"""The one base class of every error meant for the user.

A `TandemError`'s message is one line that names the culprit and what to do; `train_grpo.main`
catches the whole family and prints that line instead of a traceback, so an error class that derives
from it can never reach the user as a stack trace. Errors that mean a bug in tandem stay plain
exceptions, and keep their traceback.
"""


class TandemError(Exception):
    """An error whose message is one line for the user (no traceback)."""
