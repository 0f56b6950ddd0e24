"""Checkpoints that can be verified, a damaged newest one that falls back, and a full disk.

One module-scoped 2-rank launch (split: generator rank 0, trainer rank 1) writes step_2 and step_4;
each case damages a copy of its folder. Cases whose behaviour spans ranks (a resume that falls
back, none that loads, a save out of space) launch real jobs; the verification of each file and the
disk arithmetic are called directly.
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

from grpo.config import load_config
from grpo.distributed.preflight import StartupError, check_checkpoints, disk_needed
from grpo.train.checkpoint import Failure, on_every_rank, save_checkpoint
from grpo.train.checkpoint_folders import (
    MANIFEST,
    CheckpointDamaged,
    check_matches,
    complete_checkpoints,
    damage,
    find_resume,
    incomplete_checkpoints,
    set_aside_newer,
)
from grpo.train.export import export_hf
from grpo.train.save_errors import CheckpointSaveError
from tests.dist_utils import one_thread, single_process_group
from tests.test_checkpoint import _trainer
from tests.test_e2e import REPO, command, launch, launch_env, metrics
from tests.test_run_safety import our_traceback
from tests.trainer_setup import ARGS

FAST = [
    "--eval.num_prompts=4",
    "--data.prompts_per_step=4",
    "--grpo.group_size=4",
    "--checkpoint.every=2",
    "--rewards.num_workers=0",
    "--metrics.samples_every=0",
]
SHARD = "trainer/__0_0.distcp"  # the one trainer rank's shard file


def run_args(run_dir: Path, steps: int, *extra: str) -> list[str]:
    return [*FAST, f"--training.steps={steps}", f"--job.output_dir={run_dir}", *extra]


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """A run folder whose 4-step 2-rank run saved step_2 and step_4 (checkpoint.keep = 2)."""
    run_dir = tmp_path_factory.mktemp("written") / "run"
    result = launch(run_args(run_dir, 4), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def copy_run(written: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the written run folder: (the folder, its checkpoints folder)."""
    run_dir = tmp_path / "run"
    shutil.copytree(written, run_dir)
    return run_dir, run_dir / "checkpoints"


def cut(file: Path) -> tuple[int, int]:
    """Truncate `file` to half its size: (bytes left, bytes written)."""
    size = file.stat().st_size
    os.truncate(file, size // 2)
    return size // 2, size


def scramble(file: Path) -> None:
    """Overwrite `file` with as many random bytes: its size still matches the manifest."""
    file.write_bytes(os.urandom(file.stat().st_size))


def files_of(folder: Path) -> dict[str, int]:
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def steps_logged(run_dir: Path) -> list[int]:
    return [row["step"] for row in metrics(run_dir)]


def lines_starting(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


# ------------------------------------------------------------------------------ the manifest


def test_the_manifest_lists_every_file_with_the_size_written(written):
    for step in (2, 4):
        folder = written / "checkpoints" / f"step_{step}"
        listed = json.loads((folder / MANIFEST).read_text())["files"]
        assert listed == {name: size for name, size in files_of(folder).items() if name != MANIFEST}
        assert {"run_state.json", "trainer/.metadata", SHARD, "rng/rank_0.pt", "rng/rank_1.pt"} <= set(listed)
        assert damage(folder) is None


def test_a_checkpoint_saved_before_manifests_is_resumed_as_before(written, tmp_path):
    run_dir, checkpoints = copy_run(written, tmp_path)
    (checkpoints / "step_4" / MANIFEST).unlink()
    assert damage(checkpoints / "step_4") is None
    assert find_resume(run_dir, "auto", announce=False) == checkpoints / "step_4"


# ------------------------------------------------------------------------------ a damaged newest checkpoint


def test_a_cut_shard_falls_back_to_the_checkpoint_before(written, tmp_path):
    """The newest checkpoint's shard is cut in half: the rerun warns once, sets it aside whole and
    continues from step_2; metrics.jsonl has every step once, in order."""
    run_dir, checkpoints = copy_run(written, tmp_path)
    left, size = cut(checkpoints / "step_4" / SHARD)
    damaged_files = files_of(checkpoints / "step_4")
    result = launch(run_args(run_dir, 6), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    set_aside = checkpoints / "damaged-step_4"
    assert lines_starting(result.stderr, "warning: checkpoint") == [
        f"warning: checkpoint {checkpoints / 'step_4'} is damaged ({SHARD} has {left} of {size} bytes); "
        f"set aside as {set_aside}, resuming from {checkpoints / 'step_2'}"
    ]
    assert f"resuming from {checkpoints / 'step_2'} at step 2" in result.stdout
    assert files_of(set_aside) == damaged_files
    assert steps_logged(run_dir) == list(range(7))
    # checkpoint.keep = 2 pruned step_2 once step_6 was whole; the set-aside one is never pruned
    assert sorted(p.name for p in checkpoints.iterdir()) == ["damaged-step_4", "step_4", "step_6"]


@pytest.mark.parametrize("name", ["trainer/.metadata", "run_state.json", "rng/rank_0.pt"])
def test_a_cut_file_is_found_before_anything_loads(written, tmp_path, capsys, name):
    run_dir, checkpoints = copy_run(written, tmp_path)
    newest, before = checkpoints / "step_4", checkpoints / "step_2"
    left, size = cut(newest / name)
    assert damage(newest) == f"{name} has {left} of {size} bytes"
    assert find_resume(run_dir, "auto", announce=False) == before
    set_aside_newer(before, {})
    assert capsys.readouterr().err.splitlines() == [
        f"warning: checkpoint {newest} is damaged ({name} has {left} of {size} bytes); "
        f"set aside as {checkpoints / 'damaged-step_4'}, resuming from {before}"
    ]
    assert complete_checkpoints(checkpoints) == [before] and incomplete_checkpoints(checkpoints) == []
    assert (checkpoints / "damaged-step_4" / name).stat().st_size == left


def test_overwritten_metadata_of_the_same_size_does_not_parse(written, tmp_path):
    run_dir, checkpoints = copy_run(written, tmp_path)
    scramble(checkpoints / "step_4" / "trainer" / ".metadata")
    assert damage(checkpoints / "step_4").startswith("trainer/.metadata does not parse: ")
    assert find_resume(run_dir, "auto", announce=False) == checkpoints / "step_2"


def test_a_checkpoint_that_verifies_but_does_not_load_falls_back(written, tmp_path):
    run_dir, checkpoints = copy_run(written, tmp_path)
    scramble(checkpoints / "step_4" / SHARD)
    assert damage(checkpoints / "step_4") is None
    result = launch(run_args(run_dir, 6), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    [warning] = lines_starting(result.stderr, "warning: checkpoint")
    assert warning.startswith(f"warning: checkpoint {checkpoints / 'step_4'} is damaged (it does not load on rank 1: ")
    assert warning.endswith(f"); set aside as {checkpoints / 'damaged-step_4'}, resuming from {checkpoints / 'step_2'}")
    assert steps_logged(run_dir) == list(range(7))


def test_a_second_ctrl_c_inside_a_load_is_not_taken_for_damage():
    """DCP wraps the KeyboardInterrupt of a second Ctrl-C in its CheckpointException: it goes on up,
    and the checkpoint being loaded is not reported as failing."""

    def interrupted_load() -> None:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as interrupt:
            raise CheckpointException("load", {0: _wrap_exception(interrupt)}) from None

    with single_process_group():
        assert on_every_rank(lambda: 1 / 0)[2] == {0: Failure("ZeroDivisionError: division by zero", False)}
        with pytest.raises(CheckpointException):
            on_every_rank(interrupted_load)


def test_when_no_checkpoint_loads_the_run_stops_with_one_line_naming_each(written, tmp_path):
    run_dir, checkpoints = copy_run(written, tmp_path)
    for step in (2, 4):
        scramble(checkpoints / f"step_{step}" / SHARD)
    result = launch(run_args(run_dir, 6), nproc=2)
    assert result.returncode == 1
    [error] = lines_starting(result.stderr, "error:")
    assert error.startswith(f"error: no checkpoint in {checkpoints} can be resumed (step_4: it does not load on rank 1: ")
    assert "; step_2: it does not load on rank 1: " in error
    assert error.endswith(f"move them out of {checkpoints} to start this run afresh, or point job.output_dir at another folder")
    assert not our_traceback(result.stderr), result.stderr[-3000:]
    # nothing is renamed when nothing loads, and the run's records are as they were
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_2", "step_4"]
    assert steps_logged(run_dir) == list(range(5))


def test_when_every_checkpoint_is_cut_find_resume_names_each(written, tmp_path):
    run_dir, checkpoints = copy_run(written, tmp_path)
    cuts = {step: cut(checkpoints / f"step_{step}" / "run_state.json") for step in (2, 4)}
    with pytest.raises(CheckpointDamaged) as raised:
        find_resume(run_dir, "auto", announce=False)
    assert str(raised.value) == (
        f"no checkpoint in {checkpoints} can be resumed (step_4: run_state.json has {cuts[4][0]} of {cuts[4][1]} bytes; "
        f"step_2: run_state.json has {cuts[2][0]} of {cuts[2][1]} bytes); move them out of {checkpoints} to start "
        "this run afresh, or point job.output_dir at another folder"
    )
    with pytest.raises(CheckpointDamaged, match=r"checkpoint.resume = '.*step_4' is damaged \(run_state.json has"):
        find_resume(run_dir, str(checkpoints / "step_4"), announce=False)


# ------------------------------------------------------------------------------ disk space


@contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `path` for the block; skips the test where mounting is not permitted."""
    path.mkdir(parents=True)
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                 capture_output=True, text=True)
    except OSError as error:
        pytest.skip(f"cannot mount a tmpfs here: {error}")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        gc.collect()  # torch's writer keeps a file open until its failed save's error is collected
        subprocess.run(["umount", "--lazy", str(path)], check=True)


def fill(disk: Path, leave: int) -> None:
    (disk / "filler").write_bytes(b"\0" * max(0, shutil.disk_usage(disk).free - leave))


def test_a_save_that_finds_the_disk_full_stops_with_one_line_and_keeps_the_older_checkpoint(tmp_path):
    """On a 5 MB disk, a reward function fills the disk once step_2 is saved: saving step_4 stops
    every rank with the space line; step_2 is whole, and resumes on a larger disk."""
    with small_disk(tmp_path / "small", "5m") as disk:
        run_dir, checkpoints = disk / "run", disk / "run" / "checkpoints"
        env = {**launch_env(), "FILL_DISK_RUN": str(run_dir), "FILL_DISK_LEAVE": "400000"}
        rewards = '--rewards.functions=["tests.fixtures.slow_rewards:fill_disk_after_first_checkpoint"]'
        args = run_args(run_dir, 6, "--checkpoint.keep=1", rewards)
        result = subprocess.run(command(args, 2), cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
        assert result.returncode == 1, result.stderr[-3000:]
        [error] = lines_starting(result.stderr, "error:")
        assert re.fullmatch(
            rf"error: out of disk space saving checkpoint {re.escape(str(checkpoints / 'step_4'))}: it needs about "
            rf"1\.\d\d MB and [\d.]+ kB are free; the older checkpoints in {re.escape(str(checkpoints))} are as they "
            r"were \(free some space or lower checkpoint.keep, then run the same command to resume\)",
            error,
        ), error
        assert not our_traceback(result.stderr), result.stderr[-3000:]
        assert sorted(p.name for p in checkpoints.iterdir()) == ["step_2"]
        assert damage(checkpoints / "step_2") is None
        (run_dir / "filler").unlink()
        shutil.copytree(run_dir, tmp_path / "larger")
    larger = tmp_path / "larger"
    resumed = launch(run_args(larger, 6, "--checkpoint.keep=1"), nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {larger / 'checkpoints' / 'step_2'} at step 2" in resumed.stdout
    assert steps_logged(larger) == list(range(7))


def _older_checkpoint(root: Path) -> Path:
    """A small checkpoint folder as saved before manifests, standing for the older checkpoints."""
    older = root / "step_1"
    (older / "trainer").mkdir(parents=True)
    (older / "trainer" / ".metadata").write_bytes(b"older")
    (older / "run_state.json").write_text('{"step": 1}')
    return older


@pytest.mark.parametrize("with_trainer", [False, True], ids=["torch-writer", "dcp"])
def test_a_save_that_runs_out_of_space_removes_its_folder(tmp_path, with_trainer):
    """The disk fills while writing (torch's writer on the RNG file reports it without an errno, DCP
    with ENOSPC): out of space, no .tmp-step_2 left, the older checkpoint as it was."""
    with small_disk(tmp_path / "small", "1m") as disk, single_process_group(), one_thread():
        root = disk / "checkpoints"
        older = _older_checkpoint(root)
        before = files_of(older)
        trainer = _trainer(1) if with_trainer else None
        fill(disk, leave=8192)
        with pytest.raises(CheckpointSaveError) as raised:
            save_checkpoint(root, 2, trainer, None, {"step": 2}, is_writer=True, keep=1, needed_bytes=4096)
        assert str(raised.value).startswith(f"out of disk space saving checkpoint {root / 'step_2'}: it needs about 4.1 kB")
        assert sorted(p.name for p in root.iterdir()) == ["step_1"]
        assert files_of(older) == before


def test_an_hf_export_that_runs_out_of_space_stops_with_one_line_and_removes_its_folder(tmp_path):
    with small_disk(tmp_path / "small", "1m") as disk, single_process_group(), one_thread():
        trainer = _trainer(1)
        weights = sum(p.numel() for p in trainer.model.parameters()) * 4
        fill(disk, leave=weights // 2)
        target = disk / "hf" / "step_2"
        target.parent.mkdir()
        with pytest.raises(CheckpointSaveError) as raised:
            export_hf(trainer, ARGS, None, target, is_writer=True, needed_bytes=weights)
        assert str(raised.value).startswith(f"out of disk space exporting the policy to {target}: it needs about ")
        assert "\n" not in str(raised.value)
        assert list(target.parent.iterdir()) == []


def test_a_save_without_room_for_one_checkpoint_writes_nothing(tmp_path):
    with single_process_group():
        root = tmp_path / "checkpoints"
        older = _older_checkpoint(root)
        with pytest.raises(CheckpointSaveError, match=r"saving checkpoint .*step_2: it needs about 1000000.00 GB and "):
            save_checkpoint(root, 2, None, None, {"step": 2}, is_writer=True, keep=1, needed_bytes=10**15)
        assert [p.name for p in root.iterdir()] == [older.name]


def _needed(*options: str, start: int = 0, on_disk: int = 0) -> tuple[int, str]:
    return disk_needed(load_config(list(options), world_size=2), 1200, 400, start, on_disk)


def test_the_start_up_check_counts_keep_plus_one_checkpoints_and_every_export_due():
    """Hand-counted: checkpoints 1200 bytes, HF exports 400."""
    # saves at 2, 4, 6, 8, 10; at most keep + 1 = 3 on disk; one export, at the end
    needed, what = _needed("--training.steps=10", "--checkpoint.every=2", "--checkpoint.keep=2")
    assert needed == 3 * 1200 + 400
    assert what == ("3 more checkpoints of about 1.2 kB (checkpoint.keep = 2 keeps that many, and each new one is "
                    "written before the oldest is deleted) and 1 HF export of about 0.4 kB")
    # keep = 0 keeps all: saves at 3, 6, 9 and 10; exports at 4, 8 and 10
    keep_all = ("--training.steps=10", "--checkpoint.every=3", "--checkpoint.keep=0", "--checkpoint.export_hf_every=4")
    assert _needed(*keep_all) == (4 * 1200 + 3 * 400, "4 more checkpoints of about 1.2 kB (checkpoint.keep = 0 keeps "
                                  "them all) and 3 HF exports of about 0.4 kB")
    # resumed at step 6 with 2 on disk: saves at 8 and 10, one more than the 2 at a time; the export at 5 is done
    resumed = ("--training.steps=10", "--checkpoint.every=2", "--checkpoint.keep=2", "--checkpoint.export_hf_every=5")
    assert _needed(*resumed, start=6, on_disk=2)[0] == 1200 + 400
    # 3 on disk with keep = 2: the first save still adds one before pruning
    assert _needed("--training.steps=10", "--checkpoint.every=2", "--checkpoint.keep=2", start=6, on_disk=3)[0] == 1600
    # keep = 1: saves at 50, 100, 150, two at a time
    assert _needed("--training.steps=150", "--checkpoint.every=50", "--checkpoint.keep=1")[0] == 2 * 1200 + 400
    # checkpoint.every = 0: the last step only
    assert _needed("--training.steps=7", "--checkpoint.every=0", "--checkpoint.keep=0", start=3)[0] == 1200 + 400
    # nothing left to do
    assert _needed("--training.steps=10", start=10, on_disk=2)[0] == 0


def test_the_start_up_check_names_what_does_not_fit(tmp_path):
    cfg = load_config([f"--job.output_dir={tmp_path}"], world_size=2)  # 150 steps, every 50, keep 2
    with pytest.raises(StartupError) as raised:
        check_checkpoints(cfg, {"w": (10**12,)}, None)
    assert str(raised.value).startswith(
        "not enough free disk for 3 more checkpoints of about 12000.00 GB (checkpoint.keep = 2 keeps that many, and "
        f"each new one is written before the oldest is deleted) and 1 HF export of about 4000.00 GB in '{tmp_path}': "
        "it needs about 40000.00 GB and "
    )


def test_a_checkpoint_whose_metadata_is_garbage_is_named_in_one_line(tmp_path):
    """A checkpoint from before manifests whose trainer/.metadata does not unpickle: resuming it
    says which file, and what to do, in one line (it raised pickle's own error before)."""
    older = _older_checkpoint(tmp_path / "checkpoints")
    with pytest.raises(CheckpointDamaged) as raised:
        check_matches(older, {"w": (2, 2)})
    message = str(raised.value)
    assert message.startswith(f"checkpoint {older} cannot be read: {older / 'trainer' / '.metadata'} is not checkpoint "
                              "metadata (UnpicklingError: ")
    assert "\n" not in message and message.endswith('or set checkpoint.resume = "none" to start afresh')
