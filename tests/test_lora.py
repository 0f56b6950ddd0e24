"""LoRA (model/lora.py, grpo/engine/adapters.py): the adapted forward against the merged model, where
gradients go, what the optimizer holds, the adapter-only sync into the engine, checkpoints, the
PEFT export, and the [lora] config checks."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.func import functional_call

from grpo.config import ConfigError, load_config
from grpo.engine import NativeEngine, SamplingParams
from grpo.train.checkpoint import load_checkpoint, save_checkpoint
from grpo.train.checkpoint_folders import saved_shapes
from grpo.train.export import export_hf
from grpo.train.trainer import Trainer
from model import Transformer
from model.lora import TARGETS, LoRALinear, LoRASpec, apply_lora
from model.parallelize import tensor_parallel_layout
from tests.dist_utils import one_thread, run_ranks, single_process_group
from tests.trainer_setup import ARGS, V, build_model, grpo_config, make_batch, optim_config

SPEC = LoRASpec(rank=4, alpha=8.0, targets=("q", "v", "o", "gate", "down"))


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_thread():
        yield


def _randomise_adapters(model: torch.nn.Module, seed: int) -> None:
    """Non-zero B (and a fresh A), so that the adapters change the model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith((".lora_A", ".lora_B")):
                param.copy_(torch.randn(param.shape, generator=g) * 0.3)


def _adapted_model(seed: int = 1) -> Transformer:
    model = build_model()
    apply_lora(model, SPEC, torch.float32)
    _randomise_adapters(model, seed)
    return model


def _merged_by_hand(model: Transformer) -> dict[str, torch.Tensor]:
    """The plain model's state with W + (alpha / r) B A in every adapted layer, in fp64 then fp32."""
    state = {}
    for name, param in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        if leaf in ("lora_A", "lora_B"):
            continue
        layer = model.get_submodule(module)
        if leaf == "weight" and isinstance(layer, LoRALinear):
            delta = layer.lora_B.double() @ layer.lora_A.double() * (SPEC.alpha / SPEC.rank)
            param = (param.double() + delta).float()
        state[name] = param.detach()
    return state


def test_targets_match_the_config_words():
    from grpo.config.sections import LORA_TARGETS

    assert tuple(TARGETS) == LORA_TARGETS


def test_forward_equals_the_merged_model():
    adapted = _adapted_model()
    plain = Transformer(ARGS, dtype=torch.float32)
    plain.load_state_dict(_merged_by_hand(adapted))
    tokens = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
    got, want = adapted(tokens), plain(tokens)
    assert not torch.allclose(build_model()(tokens), want, atol=1e-3)  # the adapters do change the model
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_gradients_reach_only_the_adapters():
    """Adapter gradients equal those of W + s·B·A written out in the test; the base gets none."""
    adapted = _adapted_model()
    tokens = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
    adapted(tokens).logsumexp(-1).sum().backward()
    leaves = {n: p.detach().clone().requires_grad_(True) for n, p in adapted.named_parameters() if p.requires_grad}
    assert set(leaves) == {f"{m}.lora_{x}" for m in SPEC.module_names(ARGS.n_layers) for x in "AB"}
    plain = build_model()
    params = {n: p.detach() for n, p in plain.named_parameters()}
    for module in SPEC.module_names(ARGS.n_layers):
        a, b = leaves[f"{module}.lora_A"], leaves[f"{module}.lora_B"]
        params[f"{module}.weight"] = params[f"{module}.weight"] + (SPEC.alpha / SPEC.rank) * b @ a
    functional_call(plain, params, (tokens,)).logsumexp(-1).sum().backward()
    for name, param in adapted.named_parameters():
        if name in leaves:
            torch.testing.assert_close(param.grad, leaves[name].grad, atol=1e-5, rtol=1e-4)
        else:
            assert param.grad is None and not param.requires_grad, name


def _trainer(compute_dtype: torch.dtype, spec: LoRASpec = SPEC, fsdp: bool = False) -> Trainer:
    mesh = init_device_mesh("cpu", (1,))
    return Trainer(build_model(), mesh, torch.device("cpu"), compute_dtype, grpo_config(), optim_config(),
                   total_steps=10, micro_batch_tokens=40, temperature=0.7, max_new_tokens=8, lora=spec,
                   fsdp_on_one_rank=fsdp)


@pytest.mark.parametrize("fsdp", [False, True], ids=["one-rank", "fsdp2"])
def test_trainer_steps_only_adapters_and_extra_trainables(fsdp):
    """Base frozen in the compute dtype (bf16) and unchanged by a step; adapters and the extra
    trainable norm are fp32 masters that move; the optimizer holds state for exactly those."""
    spec = LoRASpec(SPEC.rank, SPEC.alpha, SPEC.targets, trainable=("norm.weight",))
    with single_process_group():
        trainer = _trainer(torch.bfloat16, spec, fsdp)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train(make_batch())
        trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
        assert trained == {"norm.weight"} | {f"{m}.lora_{x}" for m in spec.module_names(ARGS.n_layers) for x in "AB"}
        assert trainer.trained_names == [n for n, _ in trainer.model.named_parameters() if n in trained]
        with_state = {n for n, p in trainer.model.named_parameters() if trainer.optimizer.state.get(p)}
        assert with_state == trained
        for name, param in trainer.model.named_parameters():
            param = param.full_tensor() if hasattr(param, "full_tensor") else param
            old = before[name].full_tensor() if hasattr(before[name], "full_tensor") else before[name]
            assert param.dtype == (torch.float32 if name in trained else torch.bfloat16), name
            changed = not torch.equal(param, old)
            assert changed == (name in trained), name


def _adapters_after_one_step(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Whole adapters after one update on `world` trainer ranks, each training its share of the groups."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(5)
    trainer = Trainer(build_model(), mesh, torch.device("cpu"), torch.float32, grpo_config(), optim_config(),
                      total_steps=10, micro_batch_tokens=40, temperature=0.7, max_new_tokens=8, lora=SPEC,
                      activation_checkpointing=True)
    batch = make_batch()
    trainer.train(batch.select([i for i in range(len(batch)) if int(batch.prompt_index[i]) % world == rank]))
    return {n: t.clone() for n, _, t in trainer.full_weights(torch.float32, set(trainer.trained_names))}


def test_two_fsdp2_trainer_ranks_train_the_adapters_as_one_does(tmp_path):
    with single_process_group():
        one = _adapters_after_one_step(0, 1)
    two = run_ranks(_adapters_after_one_step, 2, tmp_path, timeout_s=120)
    for rank_result in two:
        assert rank_result.keys() == one.keys()
        for name, value in one.items():
            torch.testing.assert_close(rank_result[name], value, atol=1e-6, rtol=1e-5)
    assert not torch.equal(one["layers.0.attention.wq.lora_B"], torch.zeros_like(one["layers.0.attention.wq.lora_B"]))


def _engine(lora: LoRASpec | None) -> NativeEngine:
    return NativeEngine(ARGS, SamplingParams(4), eos_ids=[0], seed=0, dtype=torch.bfloat16, device="cpu", lora=lora)


def test_adapter_only_sync_leaves_engine_weights_equal_to_the_trainers_merge():
    """Colocated refresh: the whole policy once, then only adapters after each of two updates; the
    engine's weights are then bitwise the trainer's merged weights (in the engine's dtype, from the
    unmerged base each time, not merged on top of the previous merge), in the same storage."""
    with single_process_group():
        trainer = _trainer(torch.bfloat16)
        engine = _engine(SPEC)
        params = dict(engine.model.named_parameters())
        addresses = {n: p.data_ptr() for n, p in params.items()}
        engine.update_weights([trainer.full_weights(torch.bfloat16)], 0)
        batch = make_batch()
        for version in (1, 2):
            trainer.train(batch)
            sent = []
            updates = ((n, i, t) for n, i, t in trainer.full_weights(torch.bfloat16, set(trainer.trained_names))
                       if not sent.append(n))
            engine.update_weights([updates], version)
            assert sent and all(n.endswith((".lora_A", ".lora_B")) for n in sent)
            for name, layer in trainer.model.named_modules():
                if isinstance(layer, LoRALinear):
                    a, b = layer.lora_A.to(torch.bfloat16), layer.lora_B.to(torch.bfloat16)
                    want = (layer.weight.float() + SPEC.scale * b.float() @ a.float()).to(torch.bfloat16)
                    assert torch.equal(params[f"{name}.weight"], want), (version, name)
            for name, param in trainer.model.named_parameters():
                if name in params and not any(name == f"{m}.weight" for m in SPEC.module_names(ARGS.n_layers)):
                    assert torch.equal(params[name], param.detach().to(torch.bfloat16)), name
        assert {n: p.data_ptr() for n, p in params.items()} == addresses


def test_tensor_parallel_layout_splits_adapters_with_their_layer():
    from torch.distributed.tensor.placement_types import Replicate, Shard

    layout = functools.partial(tensor_parallel_layout, args=ARGS, tp=2, tp_rank=1)
    assert layout("layers.0.attention.wq.lora_B")[0] == (Shard(0),)
    assert layout("layers.0.attention.wq.lora_A")[0] == (Replicate(),)
    assert layout("layers.0.attention.wo.lora_A")[0] == (Shard(1),)
    assert layout("layers.0.attention.wo.lora_B")[0] == (Replicate(),)
    assert layout("layers.0.feed_forward.w2.lora_A")[0] == (Shard(1),)


def _adapter_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    state = {}
    for name in trainer.trained_names:
        param = trainer.model.get_parameter(name)
        state[name] = param.detach().clone()
        for key, value in trainer.optimizer.state[param].items():
            state[f"{name}/{key}"] = value.clone()
    return state


def test_checkpoint_holds_adapters_only_and_resumes_them_exactly(tmp_path):
    root = tmp_path / "checkpoints"
    with single_process_group():
        trainer = _trainer(torch.float32)
        batch = make_batch()
        trainer.train(batch)
        save_checkpoint(root, 1, trainer, dist.group.WORLD, {"step": 1}, True, keep=2)
        saved = _adapter_state(trainer)
        assert set(saved_shapes(root / "step_1")) == set(trainer.trained_names)
        torch.manual_seed(99)  # another A init: the load must overwrite it
        resumed = _trainer(torch.float32)
        load_checkpoint(root / "step_1", resumed, dist.group.WORLD)
        loaded = _adapter_state(resumed)
        assert loaded.keys() == saved.keys() and any(k.endswith("/exp_avg_sq") for k in saved)
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), key
        trainer.train(batch)
        resumed.train(batch)
        for name in trainer.trained_names:
            assert torch.equal(trainer.model.get_parameter(name), resumed.model.get_parameter(name)), name
    metadata = dcp.FileSystemReader(str(root / "step_1" / "trainer")).read_metadata()
    assert not [k for k in metadata.state_dict_metadata if k.startswith("trainer.model.") and "lora_" not in k]


def test_exports_merged_model_and_peft_adapter_with_the_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    with single_process_group():
        trainer = _trainer(torch.float32)
        _randomise_adapters(trainer.model, seed=3)
        export_hf(trainer, ARGS, None, tmp_path / "merged", is_writer=True)
    base = build_model()
    base_dir = tmp_path / "base"
    from model import to_hf

    to_hf(base, base_dir)
    tokens = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trainer.model(tokens)
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
        hf_base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
        with_adapter = peft.PeftModel.from_pretrained(hf_base, str(tmp_path / "merged" / "adapter"))
        torch.testing.assert_close(merged(tokens).logits, want, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(with_adapter(tokens).logits, want, atol=2e-5, rtol=1e-4)
    assert not torch.allclose(base(tokens), want, atol=1e-3)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lora.rank=-1"], "lora.rank = -1 must be >= 0 (0 = off)"),
        (["--lora.rank=4", "--lora.alpha=0"], "lora.alpha = 0.0 must be > 0 (the adapters' scale is alpha / rank)"),
        (["--lora.rank=4", '--lora.targets=["q", "gates"]'], "lora.targets has unknown layer \"gates\" (did you mean 'gate'?)"),
        (["--lora.rank=4", '--lora.targets=["q", "q"]'], 'lora.targets = ["q", "q"] names q more than once'),
        (["--lora.rank=4", "--lora.dropout=0.05"], "lora.dropout = 0.05 is not supported: the adapters are merged"),
        (["--lora.rank=4", '--lora.trainable=["norm.weigth"]'],
         "lora.trainable pattern \"norm.weigth\" matches no parameter of the model (did you mean 'norm.weight'?)"),
        (["--lora.rank=4", '--lora.trainable=["layers.*.attention.wq.weight"]'],
         'lora.trainable pattern "layers.*.attention.wq.weight" matches layers.0.attention.wq.weight, a weight'),
    ],
)
def test_bad_lora_settings_are_one_line(args, message):
    with pytest.raises(ConfigError) as error:
        load_config(args, world_size=2)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_lora_settings_load():
    cfg = load_config(["--lora.rank=8", "--lora.alpha=16", '--lora.trainable=["norm.weight"]', "--job.bitwise_logprobs=true"],
                      world_size=2)
    assert (cfg.lora.rank, cfg.lora.targets) == (8, list(TARGETS))


def test_base_of_a_trainer_is_what_a_hf_export_is_made_from(tmp_path):
    """A run's export folder: the merged model plus adapter/ (PEFT) and nothing named lora in the weights."""
    from safetensors.torch import load_file

    with single_process_group():
        trainer = _trainer(torch.float32)
        export_hf(trainer, ARGS, None, tmp_path / "hf", is_writer=True)
    names = set(load_file(tmp_path / "hf" / "model.safetensors"))
    assert not [n for n in names if "lora" in n]
    assert (Path(tmp_path / "hf" / "adapter" / "adapter_config.json")).is_file()
