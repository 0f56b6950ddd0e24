"""The native decoder against HF transformers (logits, config forms, checkpoints out, bf16
loading) and its decode from the engine's slots against its full forward. Attention over
packed rows is in test_attention.py, the log-prob head in test_logprob_head.py, refused
configurations and damaged checkpoints in test_model_loading.py, the HF reference models in
tests/hf_models.py.

Every model here is tiny and random; HF reference models get non-trivial norm / bias / q-k-norm
weights so that those code paths actually change the outputs.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from grpo.engine.cache import SlotCache
from grpo.engine.slot_step import read_slots
from model import (
    ModelArgs,
    Transformer,
    from_hf,
    to_hf,
)
from model.model import rope_inv_freq

# pytest finds a test's fixtures among its module's names
from tests.hf_models import (  # noqa: F401
    ARCHS,
    LLAMA3_ROPE,
    SEQ_LEN,
    VOCAB,
    hf_dirs,
    hf_logits,
    hf_models,
    make_hf,
    our_logits,
    tokens,
)
from tests.native_models import native_model, randomize_

transformers = pytest.importorskip("transformers")

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


# --------------------------------------------------------------------------------------------- 4. export


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


# --------------------------------------------------------------------------------------------- 5. KV cache (the engine's slots)


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


# --------------------------------------------------------------------------------------------- 6. bf16 loading


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
