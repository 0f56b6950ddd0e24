"""Which checkpoints a run has and which of them are whole: the folders under
<job.output_dir>/checkpoints, each checked against its manifest (files and sizes, written last)
before a resume, the choice of the checkpoint to resume from, and damaged ones set aside as
damaged-step_N (renamed, never deleted). What a checkpoint holds and how it is written and loaded:
checkpoint.py."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from grpo.distributed.faults import restart_count
from grpo.errors import TandemError

CHECKPOINTS = "checkpoints"
RUN_STATE = "run_state.json"
MANIFEST = "manifest.json"
TRAINER_DIR = "trainer"
# the prefix of a checkpoint set aside as damaged: no listing, resume or pruning picks it up
DAMAGED = "damaged-"
_STEP_DIR = re.compile(r"step_(\d+)")


class CheckpointMismatch(TandemError, ValueError):
    """A checkpoint that cannot be resumed here; the message names it and what does not fit."""


class CheckpointDamaged(TandemError, RuntimeError):
    """No checkpoint to resume is whole: the message lists each one tried and why it failed."""


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS


def _is_complete(path: Path) -> bool:
    """Whether a save finished folder `path`: it has a manifest (written last), or, saved before
    manifests existed, its run state and DCP metadata. Whether its files are whole is `damage`'s question."""
    return (path / MANIFEST).is_file() or ((path / RUN_STATE).is_file() and (path / TRAINER_DIR / ".metadata").is_file())


def step_of(path: Path) -> int:
    """N of a checkpoint folder named step_N."""
    return int(path.name.removeprefix("step_"))


def complete_checkpoints(root: Path) -> list[Path]:
    """The whole checkpoints under `root`, oldest step first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.fullmatch(p.name) and _is_complete(p)]
    return sorted(found, key=step_of)


def incomplete_checkpoints(root: Path) -> list[Path]:
    """Folders a save left behind when the job died while writing them."""
    if not root.is_dir():
        return []
    return sorted(
        p
        for p in root.iterdir()
        if p.is_dir() and (p.name.startswith(".tmp-") or (_STEP_DIR.fullmatch(p.name) and not _is_complete(p)))
    )


def find_resume(output_dir: str | Path, setting: str, announce: bool) -> Path | None:
    """The checkpoint this launch continues from, per checkpoint.resume, or None to start fresh.

    "auto": the latest complete checkpoint in the output folder that `damage` finds whole (the
    newer ones are set aside once it has loaded: `set_aside_newer`). "none": start fresh, and
    refuse to overwrite an earlier run's checkpoints. A torchrun restart (--max-restarts) always
    acts as "auto": the attempt before it wrote the checkpoints. Anything else is a checkpoint
    folder, refused when it is not whole. Reads only: every rank may call it and gets the same answer.
    """
    root = checkpoint_root(output_dir)
    if not follows_latest(setting):
        path = Path(setting)
        if not _is_complete(path):
            raise CheckpointMismatch(
                f"checkpoint.resume = {setting!r} is not a complete checkpoint "
                f"(expected {RUN_STATE} and {TRAINER_DIR}/.metadata in it)"
            )
        reason = damage(path)
        if reason:
            raise CheckpointDamaged(f"checkpoint.resume = {setting!r} is damaged ({reason}); name another checkpoint")
        return path
    if announce:
        for path in incomplete_checkpoints(root):
            print(f"warning: ignoring the half-written checkpoint {path}", file=sys.stderr, flush=True)
    found = complete_checkpoints(root)
    if setting == "none" and not restart_count():
        if found:
            raise CheckpointMismatch(
                f"job.output_dir = {str(output_dir)!r} already holds checkpoints (latest: {found[-1]}); "
                'continue that run with checkpoint.resume = "auto", or choose another job.output_dir'
            )
        return None
    return _newest_whole(root, found, {}) if found else None


def follows_latest(setting: str) -> bool:
    """Whether checkpoint.resume = `setting` resumes the newest checkpoint of the output folder
    (and may fall back to older ones) rather than one named checkpoint."""
    return setting in ("auto", "none")


def damage(path: Path) -> str | None:
    """Why checkpoint `path` cannot be resumed, in a few words, or None when it looks whole: every
    file its manifest lists has the size written, and the run state and DCP metadata parse. A
    checkpoint saved before manifests existed passes as before, with its run state and DCP metadata
    there (and its run state parsing). Reads only those two small files."""
    has_manifest = (path / MANIFEST).exists()
    reason = _manifest_mismatch(path) if has_manifest else _legacy_missing(path)
    if reason:
        return reason
    try:
        if not isinstance(json.loads((path / RUN_STATE).read_text(encoding="utf-8")).get("step"), int):
            return f"{RUN_STATE} holds no step"
    except (OSError, ValueError, AttributeError) as error:
        return f"{RUN_STATE} does not parse: {one_line(error)}"
    try:
        if has_manifest:
            dcp.FileSystemReader(str(path / TRAINER_DIR)).read_metadata()
    except Exception as error:  # whatever unpickling an overwritten file raises
        return f"{TRAINER_DIR}/.metadata does not parse: {one_line(error)}"
    return None


def _manifest_mismatch(path: Path) -> str | None:
    """The first file of `path`'s manifest that is missing or has another size than was written."""
    try:
        listed = json.loads((path / MANIFEST).read_text(encoding="utf-8"))["files"]
        sizes = {str(name): int(size) for name, size in listed.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return f"{MANIFEST} does not parse: {one_line(error)}"
    for name, size in sizes.items():
        try:
            actual = (path / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual < size:
            return f"{name} has {actual} of {size} bytes"
        if actual > size:
            return f"{name} has {actual} bytes, not the {size} written"
    return None


def _legacy_missing(path: Path) -> str | None:
    """What a checkpoint without a manifest lacks of its run state and DCP metadata."""
    for name in (RUN_STATE, f"{TRAINER_DIR}/.metadata"):
        if not (path / name).is_file():
            return f"{name} is missing"
    return None


def one_line(error: BaseException) -> str:
    """`error` as "Type: first sentence of its message" on one line; DCP's CheckpointException (a
    traceback per rank) as its first rank's error. Torch's messages go on with advice that does not
    apply here (unpickling a cut file suggests weights_only=False)."""
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    text = " ".join(str(error).split()).split(". ")[0] or "(no message)"
    return f"{type(error).__name__}: {text[:200]}"


def _newest_whole(root: Path, candidates: list[Path], failed: dict[Path, str]) -> Path:
    """The newest of `candidates` (oldest first) that `damage` finds whole. Raises CheckpointDamaged
    naming every checkpoint tried, those in `failed` (path -> why it did not load) included, when none is."""
    tried = dict(failed)
    for path in reversed(candidates):
        tried[path] = damage(path)
        if tried[path] is None:
            return path
    listed = "; ".join(f"{path.name}: {why}" for path, why in sorted(tried.items(), key=lambda item: -step_of(item[0])))
    raise CheckpointDamaged(
        f"no checkpoint in {root} can be resumed ({listed}); move them out of {root} to start this run "
        "afresh, or point job.output_dir at another folder"
    )


def next_resume(output_dir: str | Path, setting: str, failed: dict[Path, str]) -> Path:
    """The checkpoint to try after those in `failed` (path -> why it did not load) failed to load:
    the newest whole one older than all of them. Raises CheckpointDamaged when there is none, or
    when checkpoint.resume names the one that failed. Reads only, like `find_resume`."""
    if not follows_latest(setting):
        path, why = next(iter(failed.items()))
        raise CheckpointDamaged(f"checkpoint.resume = {setting!r} cannot be resumed ({why}); name another checkpoint")
    root = checkpoint_root(output_dir)
    oldest_failed = min(step_of(path) for path in failed)
    older = [path for path in complete_checkpoints(root) if step_of(path) < oldest_failed]
    return _newest_whole(root, older, failed)


def set_aside_newer(resumed: Path, failed: dict[Path, str]) -> None:
    """After checkpoint `resumed` has loaded, rename each newer checkpoint beside it (skipped as
    damaged, or in `failed`: path -> why it did not load) to damaged-step_N, with one warning line
    each. Nothing is deleted. Called by one rank, once every rank is past listing checkpoints."""
    for path in complete_checkpoints(resumed.parent):
        if step_of(path) <= step_of(resumed):
            continue
        why = failed.get(path) or damage(path) or "it did not load"
        target = path.with_name(DAMAGED + path.name)
        copies = 1
        while target.exists():
            copies += 1
            target = path.with_name(f"{DAMAGED}{path.name}-{copies}")
        path.rename(target)
        print(
            f"warning: checkpoint {path} is damaged ({why}); set aside as {target}, resuming from {resumed}",
            file=sys.stderr,
            flush=True,
        )


def saved_step(path: Path) -> int:
    """The step checkpoint `path` was saved after, from its run state."""
    return json.loads((path / RUN_STATE).read_text(encoding="utf-8"))["step"]


def saved_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the policy saved in checkpoint `path`, read from DCP's metadata only.
    Metadata that does not unpickle (a checkpoint from before manifests, cut or overwritten) is
    CheckpointDamaged, named in one line."""
    try:
        metadata = dcp.FileSystemReader(str(path / TRAINER_DIR)).read_metadata()
    except Exception as error:  # unpickling garbage raises whatever the bytes lead pickle to
        raise CheckpointDamaged(
            f"checkpoint {path} cannot be read: {path / TRAINER_DIR / '.metadata'} is not checkpoint metadata "
            f"({type(error).__name__}: {error}); move the folder aside to resume from an older one, or set "
            "checkpoint.resume = \"none\" to start afresh"
        ) from None
    prefix = f"{TRAINER_DIR}.model."
    return {
        key.removeprefix(prefix): tuple(meta.size)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and hasattr(meta, "size")
    }


def check_matches(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise CheckpointMismatch unless checkpoint `path` holds exactly these parameter shapes."""
    saved = saved_shapes(path)
    for name, shape in shapes.items():
        if name not in saved:
            raise CheckpointMismatch(f"checkpoint {path} was saved from another model: it has no parameter {name}")
        if saved[name] != shape:
            raise CheckpointMismatch(
                f"checkpoint {path} was saved from another model: {name} is {list(saved[name])} there "
                f"and {list(shape)} in this run's model"
            )
    extra = sorted(set(saved) - set(shapes))
    if extra:
        raise CheckpointMismatch(
            f"checkpoint {path} was saved from another model: it has {len(extra)} parameters this model lacks "
            f"(first: {extra[0]})"
        )
