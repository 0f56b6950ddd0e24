"""The native decoder against HF transformers (logits, config forms, refusals, checkpoints in and
out, bf16 loading) and its decode from the engine's slots against its full forward. Attention over
packed rows is in test_attention.py, the log-prob head in test_logprob_head.py.

Every model here is tiny and random; HF reference models get non-trivial norm / bias / q-k-norm
weights so that those code paths actually change the outputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from grpo.engine.cache import SlotCache
from grpo.engine.slot_step import read_slots
from model import (
    CheckpointError,
    ModelArgs,
    Transformer,
    UnsupportedModelError,
    from_hf,
    to_hf,
)
from model.args import SUPPORTED_ARCHITECTURES, SUPPORTED_ROPE_TYPES
from model.model import rope_inv_freq
from tests.native_models import native_model, random_tokens, randomize_

transformers = pytest.importorskip("transformers")

VOCAB = 256
SEQ_LEN = 40  # longer than the llama3 original_max_position_embeddings below, so the scaling matters

LLAMA3_ROPE = {
    "rope_type": "llama3",
    # theta, factor and the frequency factors are chosen so that, with head_dim 16 and an original
    # context of 16, the RoPE frequencies fall in all three llama3 bands (kept / interpolated / scaled)
    "rope_theta": 500.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 2.0,
    "original_max_position_embeddings": 16,
}


def hf_config(arch: str):
    """A tiny transformers config of each supported architecture."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, rms_norm_eps=1e-6)
    if arch == "qwen3":
        # head_dim != hidden / heads, a single KV head, tied head, non-default theta
        return transformers.Qwen3Config(
            **common,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=24,
            tie_word_embeddings=True,
            max_position_embeddings=128,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        )
    if arch == "llama":
        # llama3 rope scaling, untied head, odd number of layers
        return transformers.LlamaConfig(
            **common,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            max_position_embeddings=128,
            rope_parameters=dict(LLAMA3_ROPE),
        )
    if arch == "qwen2":
        # q/k/v biases
        return transformers.Qwen2Config(
            **common,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            max_position_embeddings=128,
            use_sliding_window=False,
        )
    raise AssertionError(arch)


def make_hf(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(arch), dtype=torch.float32)
    randomize_(hf, seed)
    return hf.eval()


@torch.no_grad()
def hf_logits(hf, tokens: torch.Tensor) -> torch.Tensor:
    return hf(input_ids=tokens).logits.float()


@torch.no_grad()
def our_logits(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens).float()


ARCHS = ["qwen3", "llama", "qwen2"]


@pytest.fixture(scope="module")
def hf_models():
    """One random HF fp32 model per architecture (built once; tests must not modify them)."""
    return {arch: make_hf(arch, seed=i) for i, arch in enumerate(ARCHS)}


@pytest.fixture(scope="module")
def hf_dirs(hf_models, tmp_path_factory):
    """Each HF model saved with save_pretrained (single model.safetensors, rope_parameters config form)."""
    dirs = {}
    for arch, hf in hf_models.items():
        path = tmp_path_factory.mktemp(f"hf_{arch}")
        hf.save_pretrained(path)
        dirs[arch] = path
    return dirs


@pytest.fixture(scope="module")
def tokens():
    return random_tokens(2, SEQ_LEN, VOCAB)


# --------------------------------------------------------------------------------------------- 1. HF parity


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_parity_fp32(arch, hf_models, hf_dirs, tokens):
    hf = hf_models[arch]
    ours = from_hf(hf_dirs[arch], dtype=torch.float32)
    assert ours.args.arch == arch
    assert all(p.dtype == torch.float32 for p in ours.parameters())
    expected = hf_logits(hf, tokens)
    actual = our_logits(ours, tokens)
    assert actual.shape == expected.shape == (2, SEQ_LEN, VOCAB)
    # the test is meaningful: logits are far from constant
    assert expected.std() > 0.5
    assert (actual - expected).abs().max().item() <= 1e-4


def test_hf_parity_shapes_exercised(hf_models, hf_dirs):
    """The configs really cover what the parity tests claim to cover."""
    qwen3 = from_hf(hf_dirs["qwen3"], dtype=torch.float32).args
    assert qwen3.head_dim * qwen3.n_heads != qwen3.dim and qwen3.n_kv_heads == 1
    assert qwen3.tie_embeddings and qwen3.qk_norm and not qwen3.qkv_bias
    llama_model = from_hf(hf_dirs["llama"], dtype=torch.float32)
    llama = llama_model.args
    assert llama.n_layers == 3 and not llama.tie_embeddings and llama.rope_type == "llama3"
    assert llama_model.output is not None
    qwen2 = from_hf(hf_dirs["qwen2"], dtype=torch.float32).args
    assert qwen2.qkv_bias and not qwen2.qk_norm


def test_llama3_rope_frequencies_match_hf(hf_models, hf_dirs):
    """Our llama3 inverse frequencies equal HF's, and differ from the unscaled ones in every band."""
    args = ModelArgs.from_hf_dir(hf_dirs["llama"])
    ours = rope_inv_freq(args)
    theirs = hf_models["llama"].model.rotary_emb.inv_freq.float()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    unscaled = rope_inv_freq(ModelArgs(**{**args.__dict__, "rope_type": "default", "rope_scaling": {}}))
    ratio = ours / unscaled
    factor = LLAMA3_ROPE["factor"]
    kept = torch.isclose(ratio, torch.tensor(1.0))
    scaled = torch.isclose(ratio, torch.tensor(1 / factor))
    assert kept.any() and scaled.any() and (~kept & ~scaled).any()


# --------------------------------------------------------------------------------------------- 2. bf16


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_error_no_worse_than_hf_bf16(arch, hf_models, hf_dirs, tokens):
    hf = hf_models[arch]
    reference = hf_logits(hf, tokens)
    hf_bf16 = make_hf(arch, seed=ARCHS.index(arch)).to(torch.bfloat16)  # same weights, own copy
    for p, q in zip(hf_bf16.parameters(), hf.parameters()):
        assert torch.equal(p, q.to(torch.bfloat16))
    hf_err = (hf_logits(hf_bf16, tokens) - reference).abs()
    ours = from_hf(hf_dirs[arch], dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    out = ours(tokens)
    assert out.dtype == torch.bfloat16
    our_err = (out.float() - reference).abs()
    assert hf_err.max() > 0  # bf16 really is lossy here
    assert our_err.max() <= 1.5 * hf_err.max()
    assert our_err.mean() <= 1.5 * hf_err.mean()


# --------------------------------------------------------------------------------------------- 3. config forms


def test_rope_parameters_form_is_read(hf_dirs):
    """transformers 5.x writes rope_parameters; theta, type and llama3 scaling come from it."""
    raw = json.loads((hf_dirs["llama"] / "config.json").read_text())
    assert "rope_parameters" in raw and "rope_scaling" not in raw and "rope_theta" not in raw
    args = ModelArgs.from_hf_config(raw)
    assert args.rope_theta == LLAMA3_ROPE["rope_theta"]
    assert args.rope_type == "llama3"
    assert args.rope_scaling == {k: v for k, v in LLAMA3_ROPE.items() if k not in ("rope_type", "rope_theta")}
    qwen3 = ModelArgs.from_hf_config(json.loads((hf_dirs["qwen3"] / "config.json").read_text()))
    assert qwen3.rope_theta == 1_000_000.0 and qwen3.rope_type == "default" and qwen3.rope_scaling == {}


@pytest.mark.parametrize("type_key", ["rope_type", "type"])
def test_legacy_top_level_rope_form(type_key, hf_models, hf_dirs, tokens, tmp_path):
    """Released checkpoints carry top-level rope_theta + rope_scaling: read the same values, same logits."""
    src = hf_dirs["llama"]
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    params.pop("rope_type")
    config["rope_scaling"] = {type_key: "llama3", **params}
    (tmp_path / "config.json").write_text(json.dumps(config))

    new_args = ModelArgs.from_hf_dir(src)
    old_args = ModelArgs.from_hf_dir(tmp_path)
    assert old_args == new_args
    assert old_args.rope_type == "llama3" and old_args.rope_theta == LLAMA3_ROPE["rope_theta"]

    ours = from_hf(tmp_path, dtype=torch.float32)
    expected = hf_logits(hf_models["llama"], tokens)
    assert (our_logits(ours, tokens) - expected).abs().max().item() <= 1e-4


# --------------------------------------------------------------------------------------------- 4. refusals


def _refusal(config) -> str:
    with pytest.raises(UnsupportedModelError) as info:
        ModelArgs.from_hf_config(config)
    return str(info.value)


def test_refuses_other_architecture():
    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        architectures=["MistralForCausalLM"],
    ).to_dict()
    message = _refusal(config)
    assert "MistralForCausalLM" in message
    for supported in SUPPORTED_ARCHITECTURES:
        assert supported in message


def test_refuses_sliding_window():
    config = hf_config("qwen2")
    config.use_sliding_window = True
    config.sliding_window = 8
    config.architectures = ["Qwen2ForCausalLM"]
    message = _refusal(config.to_dict())
    assert "use_sliding_window" in message and "full attention" in message


@pytest.mark.parametrize("form", ["rope_parameters", "legacy"])
def test_refuses_unknown_rope_type(form):
    config = hf_config("qwen3").to_dict()
    config["architectures"] = ["Qwen3ForCausalLM"]
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    if form == "rope_parameters":
        config["rope_parameters"] = {**yarn, "rope_theta": 10000.0}
    else:
        config.pop("rope_parameters", None)
        config["rope_theta"] = 10000.0
        config["rope_scaling"] = yarn
    message = _refusal(config)
    assert "yarn" in message
    for supported in SUPPORTED_ROPE_TYPES:
        assert supported in message


def test_refusal_happens_before_loading(hf_dirs, tmp_path):
    config = json.loads((hf_dirs["qwen3"] / "config.json").read_text())
    config["architectures"] = ["MistralForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))  # no weights at all
    with pytest.raises(UnsupportedModelError, match="MistralForCausalLM"):
        from_hf(tmp_path)


# --------------------------------------------------------------------------------------------- 5. checkpoints


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_sharded_checkpoint(arch, hf_models, tokens, tmp_path):
    hf = hf_models[arch]
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    ours = from_hf(tmp_path, dtype=torch.float32)
    assert (our_logits(ours, tokens) - hf_logits(hf, tokens)).abs().max().item() <= 1e-4


def _copy_checkpoint(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    (dst / "config.json").write_text((src / "config.json").read_text())
    return load_file(str(src / "model.safetensors"))


def test_missing_tensor(hf_dirs, tmp_path):
    tensors = _copy_checkpoint(hf_dirs["qwen3"], tmp_path)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        from_hf(tmp_path, dtype=torch.float32)


def test_missing_untied_head(hf_dirs, tmp_path):
    tensors = _copy_checkpoint(hf_dirs["llama"], tmp_path)
    del tensors["lm_head.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"lm_head\.weight"):
        from_hf(tmp_path, dtype=torch.float32)


@pytest.mark.parametrize(
    "bogus",
    ["model.layers.0.self_attn.bogus.weight", "model.layers.9.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.bias"],
)
def test_unexpected_tensor(bogus, hf_dirs, tmp_path):
    # qwen3 has no q_proj bias and two layers: all three names are foreign to it
    tensors = _copy_checkpoint(hf_dirs["qwen3"], tmp_path)
    tensors[bogus] = torch.zeros(4, 4)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=bogus.replace(".", r"\.")):
        from_hf(tmp_path, dtype=torch.float32)


def test_misshaped_tensor(hf_dirs, tmp_path):
    tensors = _copy_checkpoint(hf_dirs["qwen2"], tmp_path)
    key = "model.layers.1.mlp.up_proj.weight"
    tensors[key] = tensors[key].t().contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        from_hf(tmp_path, dtype=torch.float32)


def test_missing_folder_or_files(hf_dirs, tmp_path):
    nowhere = tmp_path / "does-not-exist"
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        from_hf(nowhere)

    no_config = tmp_path / "no-config"
    no_config.mkdir()
    (no_config / "model.safetensors").write_bytes((hf_dirs["qwen3"] / "model.safetensors").read_bytes())
    with pytest.raises(FileNotFoundError, match="no-config"):
        from_hf(no_config)

    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((hf_dirs["qwen3"] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no-weights"):
        from_hf(no_weights)


def test_missing_shard(hf_models, tmp_path):
    hf_models["qwen3"].save_pretrained(tmp_path, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        from_hf(tmp_path)


# --------------------------------------------------------------------------------------------- 6. export


@pytest.mark.parametrize("arch", ["qwen3", "llama"])  # tied / untied
@pytest.mark.parametrize("max_shard_bytes", [5 * 2**30, 30_000])
def test_to_hf_roundtrip(arch, max_shard_bytes, hf_models, hf_dirs, tokens, tmp_path):
    original = hf_models[arch]
    ours = from_hf(hf_dirs[arch], dtype=torch.float32)
    to_hf(ours, tmp_path, max_shard_bytes=max_shard_bytes)

    index_path = tmp_path / "model.safetensors.index.json"
    if max_shard_bytes < 2**20:
        index = json.loads(index_path.read_text())
        shard_files = sorted(set(index["weight_map"].values()))
        assert len(shard_files) > 2
        sizes = {}
        for name in shard_files:
            shard = load_file(str(tmp_path / name))
            sizes[name] = sum(t.numel() * t.element_size() for t in shard.values())
            assert sizes[name] <= max_shard_bytes or len(shard) == 1
            assert all(index["weight_map"][k] == name for k in shard)
        assert index["metadata"]["total_size"] == sum(sizes.values())
    else:
        assert not index_path.exists() and (tmp_path / "model.safetensors").is_file()

    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert exported.config.tie_word_embeddings == ours.args.tie_embeddings
    if ours.args.tie_embeddings:
        assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()
    # every tensor survives the trip bit for bit ...
    exported_state = exported.state_dict()
    for name, tensor in original.state_dict().items():
        assert torch.equal(exported_state[name], tensor), name
    # ... so HF's implementation gives bit-identical logits on both, and so does ours (fp32, same ops)
    exported_logits = hf_logits(exported, tokens)
    assert torch.equal(exported_logits, hf_logits(original, tokens))
    assert torch.equal(our_logits(ours, tokens), exported_logits)
    # and the export loads back into the native model unchanged
    reloaded = from_hf(tmp_path, dtype=torch.float32)
    assert reloaded.args == ours.args
    assert torch.equal(our_logits(reloaded, tokens), our_logits(ours, tokens))


def test_to_hf_bf16_native_model(tmp_path, tokens):
    """A model built natively (not loaded) exports as bf16 and transformers reads it as such."""
    args = ModelArgs(arch="qwen2", vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                     ffn_dim=96, qkv_bias=True, qk_norm=False, tie_embeddings=True)
    ours = randomize_(Transformer(args, dtype=torch.bfloat16), seed=5)
    to_hf(ours, tmp_path)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert exported.dtype == torch.bfloat16
    ours_state = ours.state_dict()
    assert torch.equal(exported.model.layers[1].self_attn.k_proj.bias, ours_state["layers.1.attention.wk.bias"])
    assert torch.equal(exported.model.embed_tokens.weight, ours_state["tok_embeddings.weight"])


# --------------------------------------------------------------------------------------------- 7. KV cache (the engine's slots)


LLAMA3_NATIVE = dict(
    arch="llama", qk_norm=False, qkv_bias=False, n_kv_heads=1, rope_type="llama3",
    rope_theta=LLAMA3_ROPE["rope_theta"],
    rope_scaling={k: v for k, v in LLAMA3_ROPE.items() if k not in ("rope_type", "rope_theta")},
)


@pytest.mark.parametrize("arch_overrides", [{}, LLAMA3_NATIVE], ids=["qwen3-bias", "llama3-rope"])
def test_slot_cache_decode_matches_full_forward(arch_overrides):
    """Prompts of mixed lengths prefilled packed into arbitrary slots, then decoded a token at a time:
    every logit equals that sequence's own full forward."""
    model = native_model(seed=2, **arch_overrides)
    V = model.args.vocab_size
    gen = torch.Generator().manual_seed(5)
    prompt_lens, slots, steps, L = [5, 12, 3], [2, 0, 3], 6, 20
    full = [torch.randint(V, (n + steps,), generator=gen) for n in prompt_lens]
    cache = SlotCache(model.args, num_slots=4, max_len=L, dtype=torch.float32, device=torch.device("cpu"))
    with torch.no_grad():
        reference = [model(seq[None])[0] for seq in full]  # each sequence alone, one full forward
        lengths = torch.tensor(prompt_lens)
        starts = torch.cumsum(lengths, 0) - lengths
        cu = torch.cat((torch.zeros(1, dtype=torch.long), lengths.cumsum(0))).int()
        tokens = torch.cat([seq[:n] for seq, n in zip(full, prompt_lens)])
        positions = torch.cat([torch.arange(n) for n in prompt_lens])
        target = torch.cat([s * L + torch.arange(n) for s, n in zip(slots, prompt_lens)])
        attend = cache.prefill_attention(torch.arange(len(tokens)), target, cu, max(prompt_lens))
        logits = model.decode(tokens, positions, attend, logits_index=starts + lengths - 1)
        assert logits.shape == (3, V)
        for b, n in enumerate(prompt_lens):
            torch.testing.assert_close(logits[b], reference[b][n - 1], atol=1e-5, rtol=0)
        rows = torch.tensor(slots)
        for s in range(steps):
            pos = lengths + s
            step_tokens = torch.stack([full[b][pos[b]] for b in range(3)])
            cache.position[rows] = pos
            cache.done[rows] = False  # rows still going (a finished row attends to its own key only)
            logits = model.decode(step_tokens, pos, cache.decode_attention(rows, read_slots(cache, rows)))
            assert logits.shape == (3, V)
            for b in range(3):
                torch.testing.assert_close(logits[b], reference[b][pos[b]], atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------------- 8. bf16 loading


class DtypeRecorder(TorchDispatchMode):
    """Records (dtype, numel, op) of every non-meta tensor any aten op produces."""

    def __init__(self):
        super().__init__()
        self.outputs: list[tuple[torch.dtype, int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.outputs.append((t.dtype, t.numel(), str(func)))
        return out


def test_bf16_load_makes_no_fp32_copy(hf_models, tmp_path):
    hf = make_hf("qwen3", seed=0).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    args = ModelArgs.from_hf_dir(tmp_path)
    # anything fp32 beyond the RoPE frequency vector (head_dim / 2) would be a copy of some weight
    limit = args.head_dim // 2
    assert limit < args.dim  # smaller than the smallest weight (a norm vector)

    recorder = DtypeRecorder()
    with recorder:
        model = from_hf(tmp_path, dtype=torch.bfloat16)
    assert recorder.outputs  # the probe sees the loader's allocations
    big_fp32 = [o for o in recorder.outputs if o[0] == torch.float32 and o[1] > limit]
    assert not big_fp32, big_fp32[:5]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    hf_state = hf.state_dict()
    assert torch.equal(model.layers[1].attention.k_norm.weight, hf_state["model.layers.1.self_attn.k_norm.weight"])
    assert torch.equal(model.tok_embeddings.weight, hf_state["model.embed_tokens.weight"])

    # the probe catches the naive way (build in fp32, then cast)
    naive = DtypeRecorder()
    with naive:
        Transformer(args, dtype=torch.float32).to(torch.bfloat16)
    assert any(o[0] == torch.float32 and o[1] > limit for o in naive.outputs)
