"""grpo/train/checkpoint.py: DCP save/load across trainer counts, finding what to resume, shape checks,
start-up checks, and HF exports that transformers loads with the trained policy's logits."""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from grpo.distributed.preflight import StartupError, check_free_disk, check_output_dir
from grpo.train.checkpoint import load_checkpoint, save_checkpoint
from grpo.train.checkpoint_folders import CheckpointMismatch, check_matches, checkpoint_root, complete_checkpoints, find_resume
from grpo.train.trainer import Trainer
from model import Transformer
from tests.dist_utils import one_thread, run_ranks
from tests.test_e2e import launch
from tests.trainer_setup import ARGS, build_model, grpo_config, make_batch, optim_config


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


def _full_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter and AdamW state tensor as a whole tensor, keyed by name."""
    state = {}
    for name, param in trainer.model.named_parameters():
        state[name] = (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
        for key, value in trainer.optimizer.state[param].items():
            value = value.full_tensor() if isinstance(value, DTensor) else value
            state[f"{name}/{key}"] = value.detach().clone()
    return state


def _trainer(world: int) -> Trainer:
    mesh = init_device_mesh("cpu", (world,))
    return Trainer(build_model(), mesh, torch.device("cpu"), torch.float32, grpo_config(), optim_config(),
                   total_steps=10, micro_batch_tokens=12, temperature=0.7, max_new_tokens=8)


def _save_rank(rank: int, world: int, root: str):
    """Train one step on this rank's groups, save step_1, return the full state."""
    trainer = _trainer(world)
    batch = make_batch()
    groups = [g for g in range(4) if g % world == rank]
    trainer.train(batch.select([i for i in range(len(batch)) if int(batch.prompt_index[i]) - 10 in groups]))
    save_checkpoint(Path(root), 1, trainer, dist.group.WORLD, {"step": 1}, rank == 0, keep=2)
    return _full_state(trainer), trainer.scheduler.last_epoch, trainer.optimizer.param_groups[0]["lr"]


def _load_rank(rank: int, world: int, root: str):
    trainer = _trainer(world)
    state = load_checkpoint(Path(root) / "step_1", trainer, dist.group.WORLD)
    return _full_state(trainer), trainer.scheduler.last_epoch, trainer.optimizer.param_groups[0]["lr"], state


@pytest.mark.parametrize("saved_on, loaded_on", [(2, 1), (1, 2)], ids=["2to1", "1to2"])
def test_resharded_load_restores_weights_and_optimizer_bitwise(tmp_path, saved_on, loaded_on):
    """A checkpoint written by N trainer ranks loads on M: every weight and AdamW moment is bitwise
    the saved one, the LR schedule is where it was."""
    root = tmp_path / "checkpoints"
    (tmp_path / "save").mkdir()
    (tmp_path / "load").mkdir()
    saved = run_ranks(partial(_save_rank, root=str(root)), saved_on, tmp_path / "save", timeout_s=120)
    loaded = run_ranks(partial(_load_rank, root=str(root)), loaded_on, tmp_path / "load", timeout_s=120)
    reference, epoch, lr = saved[0]
    assert {"exp_avg", "exp_avg_sq"} <= {k.split("/")[1] for k in reference if "/" in k}
    for rank_state, rank_epoch, rank_lr, run_state in loaded:
        assert rank_state.keys() == reference.keys()
        for key, value in reference.items():
            assert rank_state[key].equal(value), key
        assert (rank_epoch, rank_lr) == (epoch, lr) and epoch == 1
        assert run_state["step"] == 1 and run_state["world_size"] == saved_on


def _make_checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    path = root / f"step_{step}"
    (path / "trainer").mkdir(parents=True)
    if complete:
        (path / "trainer" / ".metadata").write_bytes(b"")
        (path / "run_state.json").write_text(json.dumps({"step": step}))
    return path


def test_find_resume_picks_the_latest_complete_checkpoint_and_warns_about_half_written(tmp_path, capsys):
    root = checkpoint_root(tmp_path)
    assert find_resume(tmp_path, "auto", announce=True) is None
    _make_checkpoint(root, 2)
    latest = _make_checkpoint(root, 10)
    _make_checkpoint(root, 12, complete=False)
    (root / ".tmp-step_14").mkdir()
    assert complete_checkpoints(root) == [root / "step_2", latest]
    assert find_resume(tmp_path, "auto", announce=True) == latest
    err = capsys.readouterr().err
    assert f"warning: ignoring the half-written checkpoint {root / '.tmp-step_14'}" in err
    assert f"warning: ignoring the half-written checkpoint {root / 'step_12'}" in err
    assert find_resume(tmp_path, str(root / "step_2"), announce=False) == root / "step_2"


def test_resume_none_refuses_to_overwrite_an_earlier_run(tmp_path, monkeypatch):
    _make_checkpoint(checkpoint_root(tmp_path), 4)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    with pytest.raises(CheckpointMismatch, match=r"already holds checkpoints \(latest: .*step_4\); continue"):
        find_resume(tmp_path, "none", announce=False)
    # a torchrun restart continues what its first attempt wrote
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert find_resume(tmp_path, "none", announce=False) == checkpoint_root(tmp_path) / "step_4"


def test_resume_from_an_incomplete_folder_is_refused(tmp_path):
    path = _make_checkpoint(tmp_path, 3, complete=False)
    with pytest.raises(CheckpointMismatch, match="is not a complete checkpoint"):
        find_resume(tmp_path / "run", str(path), announce=False)


def test_shape_check_names_the_first_mismatching_parameter(tmp_path):
    model = build_model()
    dcp.save({"trainer": {"model": model.state_dict()}}, checkpoint_id=str(tmp_path / "trainer"), no_dist=True)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    check_matches(tmp_path, shapes)
    wider = {**shapes, "tok_embeddings.weight": (ARGS.vocab_size, 64)}
    with pytest.raises(CheckpointMismatch, match=r"tok_embeddings.weight is \[40, 32\] there and \[40, 64\] in this"):
        check_matches(tmp_path, wider)
    with pytest.raises(CheckpointMismatch, match="it has no parameter extra.weight"):
        check_matches(tmp_path, {**shapes, "extra.weight": (1,)})


def test_output_dir_that_cannot_be_written_is_refused(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(StartupError, match=r"job.output_dir = '.*a-file/run' is not writable: Not a directory"):
        check_output_dir(blocker / "run", rank=0)
    check_output_dir(tmp_path / "new" / "run", rank=0)
    assert list((tmp_path / "new" / "run").iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_output_dir_is_refused(tmp_path):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o555)
    with pytest.raises(StartupError, match="is not writable: Permission denied"):
        check_output_dir(read_only, rank=0)


def test_read_only_output_dir_stops_the_launch(tmp_path):
    """From the command line: one line naming the folder, exit 1, before any model is built."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = launch(["--parallelism.mode=colocated", f"--job.output_dir={blocker / 'run'}"], nproc=None, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: job.output_dir = '{blocker / 'run'}' is not writable: Not a directory"
    )


def test_free_disk_check(tmp_path):
    check_free_disk(tmp_path, 1)
    with pytest.raises(StartupError, match=r"not enough free disk for one checkpoint .* needs about 1000000000.00 GB"):
        check_free_disk(tmp_path, 10**18)


def test_checkpoint_of_another_model_shape_stops_the_launch(tmp_path):
    """Resume into a run whose model is wider: one line naming checkpoint and parameter, exit 1."""
    args = ["--parallelism.mode=colocated", "--training.steps=1", "--data.prompts_per_step=4", "--grpo.group_size=4",
            "--eval.num_prompts=4", "--rewards.num_workers=0", f"--job.output_dir={tmp_path}"]
    first = launch(args, nproc=None, timeout=120)
    assert first.returncode == 0, first.stderr[-3000:]
    wider = launch([*args, "--model.dim=128", "--model.ffn_dim=256"], nproc=None, timeout=120)
    assert wider.returncode == 1
    assert wider.stderr.strip().splitlines()[-1] == (
        f"error: checkpoint {tmp_path / 'checkpoints' / 'step_1'} was saved from another model: "
        "tok_embeddings.weight is [12, 64] there and [12, 128] in this run's model"
    )


def test_exported_hf_folder_gives_the_trained_policy_logits(tmp_path):
    """transformers.AutoModelForCausalLM on hf/step_2 and the native model loaded from the DCP
    checkpoint of the same step give the same logits."""
    from transformers import AutoModelForCausalLM

    from grpo.config import load_config
    from grpo.data.digits import CharTokenizer
    from grpo.run.rank import builtin_model_args

    args = ["--parallelism.mode=colocated", "--training.steps=2", "--data.prompts_per_step=4", "--grpo.group_size=4",
            "--eval.num_prompts=4", "--rewards.num_workers=0", f"--job.output_dir={tmp_path}"]
    result = launch(args, nproc=None, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]

    cfg = load_config(args, world_size=1)
    policy = Transformer(builtin_model_args(cfg, CharTokenizer().vocab_size), dtype=torch.float32)
    state = {"trainer": {"model": policy.state_dict()}}
    dcp.load(state, checkpoint_id=str(tmp_path / "checkpoints" / "step_2" / "trainer"), no_dist=True)
    policy.load_state_dict(state["trainer"]["model"])
    # the run's initial weights (seeded as the trainer seeds them): training moved every matrix
    torch.manual_seed(cfg.job.seed)
    initial = Transformer(policy.args, dtype=torch.float32)
    initial.init_weights()
    assert not torch.equal(initial.tok_embeddings.weight, policy.tok_embeddings.weight)

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / "step_2", torch_dtype=torch.float32)
    tokens = torch.randint(0, policy.args.vocab_size, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        actual = policy(tokens)
    assert (actual - expected).abs().max() < 1e-4
