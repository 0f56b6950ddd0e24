"""The errors of writing checkpoints and exports to disk: one line for the user, the disk's
state in it (how much is needed, how much is free), and the checks that tell a full disk from a bug."""

from __future__ import annotations

import errno

from torch.distributed.checkpoint.api import CheckpointException

from grpo.errors import TandemError


class CheckpointSaveError(TandemError, RuntimeError):
    """A checkpoint could not be written (out of disk space, an I/O error); the older ones are intact."""


def no_space(error: BaseException) -> bool:
    """Whether ENOSPC (or EDQUOT, a full quota) is in `error`'s chain."""
    return any(isinstance(c, OSError) and c.errno in (errno.ENOSPC, errno.EDQUOT) for c in error_chain(error))


def error_chain(error: BaseException) -> list[BaseException]:
    """`error`, the errors it was raised from or during, and, in DCP's CheckpointException, each rank's error."""
    found: list[BaseException] = []
    todo: list[BaseException | None] = [error]
    while todo:
        current = todo.pop()
        if current is None or any(current is seen for seen in found):
            continue
        found.append(current)
        todo += [current.__cause__, current.__context__]
        if isinstance(current, CheckpointException):
            todo += [wrapped for wrapped, _ in current.failures.values()]
    return found


def describe_bytes(count: float) -> str:
    """A byte count for people: in GB from 1 GB up, in MB from 1 MB up, in kB below."""
    for unit, size in (("GB", 1e9), ("MB", 1e6)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count / 1e3:.1f} kB"
