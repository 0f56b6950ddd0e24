"""Every error meant for the user is a TandemError, and train_grpo.main turns each into one line."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import pytest

import grpo
import model
import train_grpo
from grpo.config import ConfigError
from grpo.distributed.faults import PeerLost, peer_lost
from grpo.errors import TandemError

# The exceptions that are not a line for the user, each with the reason; a new one that is meant for
# the user and forgets the TandemError base fails the test below instead of reaching a user as a
# traceback.
NOT_FOR_THE_USER = {
    "RunAborted": "carries no message: the rank that failed prints the line and the others stop silently",
    "_BadResult": "never leaves a reward call: grpo.scoring.calls turns it into the message of a RewardError",
}

# Errors only ever built by a helper that writes their message; every other one takes its message.
BUILT_BY: dict[type[TandemError], Callable[[], TandemError]] = {
    PeerLost: lambda: peer_lost("trainer rank 1", "episodes from generator ranks [0]"),
}

ONE_RANK = ["--parallelism.mode=colocated", "--job.device=cpu"]


# Environment adapters whose modules import an optional package at the top: module prefix -> package.
ADAPTER_PACKAGES = {"grpo.envs.adapters.verifiers": "verifiers", "grpo.envs.adapters.skyrl_gym": "skyrl_gym"}


def module_names() -> list[str]:
    """The project's modules, but for the vLLM engine's, which import the optional vllm package, and
    the adapters whose optional package is not installed."""
    names = ["rewards", "train_grpo"]
    for package in (grpo, model):
        names.append(package.__name__)
        names += [info.name for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}.")]
    missing = [prefix for prefix, package in ADAPTER_PACKAGES.items() if importlib.util.find_spec(package) is None]
    return [name for name in names if not name.startswith(("grpo.engine.vllm", *missing))]


def exception_classes() -> list[type[BaseException]]:
    """Every exception class defined (not merely imported) in the project's modules."""
    found = []
    for name in module_names():
        module = importlib.import_module(name)
        found += [
            obj
            for _, obj in inspect.getmembers(module, inspect.isclass)
            if issubclass(obj, BaseException) and obj.__module__ == name
        ]
    return found


EXCEPTIONS = exception_classes()
USER_ERRORS = [cls for cls in EXCEPTIONS if issubclass(cls, TandemError)]


def test_every_exception_is_a_user_error_or_says_why_not():
    plain = {cls.__name__ for cls in EXCEPTIONS if not issubclass(cls, TandemError)}
    assert plain == set(NOT_FOR_THE_USER)


def raising(error: BaseException) -> Callable[..., NoReturn]:
    def fail(*args: object, **kwargs: object) -> NoReturn:
        raise error

    return fail


@pytest.mark.parametrize("cls", USER_ERRORS, ids=lambda cls: cls.__name__)
def test_main_reports_a_user_error_in_one_line(
    cls: type[TandemError], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    error = BUILT_BY.get(cls, lambda: cls(f"{cls.__name__}: the culprit, and what to do about it"))()
    # Each error enters main where it meets it: a ConfigError while the config loads, the rest from the job.
    if issubclass(cls, ConfigError):
        monkeypatch.setattr(train_grpo, "load_config", raising(error))
        expected_code, expected_line = 2, f"config error: {error}"
    else:
        monkeypatch.setattr(train_grpo, "run", raising(error))
        expected_code, expected_line = 1, f"error: {error}"

    code = train_grpo.main([*ONE_RANK, f"--job.output_dir={tmp_path}"])

    out, err = capsys.readouterr()
    assert code == expected_code
    assert "\n" not in str(error)
    assert expected_line in err.splitlines()
    assert "Traceback" not in out + err
