"""Who tells the user why the job stopped: one line, printed once, and torchrun's root cause.

When a job stops with an error, every rank stops: the one that failed, and the others because a
peer stopped answering. The first rank to fail with an error of its own claims the report in the
launch's store and prints its line; a rank that fails the same way after it stays silent, and a
rank that lost its peers says "rank R stopped: see its error above" (once) instead of advising a
resume. The claiming rank also writes its line to torchrun's error file, so torchrun's summary,
the last thing on the screen, shows that line as the root cause.

The store is the one the ranks met in: under torchrun its agent hosts it, so it answers when the
failing rank is gone. Where it does not answer within a few seconds, every rank prints its line,
as without a store.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch.distributed as dist

# the rank that claimed the report, plus one; and how many ranks lost their peers
_FIRST = "error_report/first_rank"
_LOST = "error_report/lost"
_STORE_TIMEOUT = timedelta(seconds=5)

_store: dist.Store | None = None


def attach(store: dist.Store | None) -> None:
    """Report through `store` (the rendezvous store of this attempt of the launch); None: this
    process has no launch yet (main starts with it, since tests call main more than once)."""
    global _store
    _store = store


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _claim_first() -> bool | None:
    """Whether this rank is the first to report (atomically, over the launch); None when the store
    does not answer."""
    if _store is None:
        return None
    mine = str(_rank() + 1)
    try:
        _store.set_timeout(_STORE_TIMEOUT)
        return _store.compare_set(_FIRST, "", mine).decode() == mine
    except Exception:  # the store's host is gone: report as if alone
        return None


def _first_rank() -> int | None:
    """The rank that claimed the report, if any rank did."""
    if _store is None:
        return None
    try:
        _store.set_timeout(_STORE_TIMEOUT)
        return int(_store.get(_FIRST)) - 1 if _store.check([_FIRST]) else None
    except Exception:
        return None


def own_error(line: str) -> None:
    """This rank stopped with an error of its own: print `line` unless another rank reported first."""
    if _claim_first() is not False:
        _say(line)


def lost_peers(line: str) -> None:
    """This rank stopped because its peers stopped answering. If one of them reported an error of
    its own, point to it (once over the launch); else say `line` (a peer died without a word)."""
    # The failing rank claims the report before it exits, and this rank notices only after that
    # exit closed the connection, so the claim is visible here.
    first = _first_rank()
    if first is None:
        own_error(line)
        return
    try:
        lost = int(_store.add(_LOST, 1))
    except Exception:
        lost = 1
    if lost == 1:
        print(f"rank {first} stopped: see its error above", file=sys.stderr, flush=True)


def config_error(line: str) -> None:
    """A bad config, found the same way on every rank before any process group: rank 0 says it.
    Every rank writes it to torchrun's error file: torchrun answers the first rank's exit with
    SIGTERM to the others, which may stop rank 0 before it has printed, and its summary then shows
    the first rank's file."""
    if _rank() == 0:
        _say(line)
    else:
        _write_error_file(line)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
    _write_error_file(line)


def _write_error_file(line: str) -> None:
    """torchrun (TORCHELASTIC_ERROR_FILE) shows this file's message as the failure's traceback."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
    except OSError:
        pass
