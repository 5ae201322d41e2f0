"""GGUF files read as stored equal Hugging Face on the dequantized weights.

Tiny random Llama (tied head), Qwen3 (untied, q/k norms), Qwen2 (q/k/v biases), Qwen3-MoE and Mixtral
(experts in 3-D tensors, each expert's blocks read as stored) models are written as
GGUF files the way llama.cpp's converter writes them (its metadata keys, its q/k row permutation for
Llama), with a different block type per projection: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/F16 blocks from gguf's own
quantizer, Q2_K/Q3_K/Q4_K/Q5_K/Q6_K/IQ4_NL/IQ4_XS random blocks (gguf has no quantizer for them). The reference is Hugging Face float32 on gguf.quants.dequantize of
those blocks; minisgl reads the file with weights_format="stored". The default model, stored, gives the
tokens of Hugging Face on today's float32 conversion on the offline example's prompts (docs/offline.md)."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from helpers import HFReference, assert_tokens_equal_hf, make_llm, random_prompt, tiny_llm_kwargs

from minisgl.core import SamplingParams
from minisgl.gguf.stored import StoredWeight
from minisgl.kernel import cpu

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# per HF projection: the block type it is stored as (a merged QKV of three types, K-quants, F16)
LLAMA_TYPES = {
    "q_proj": Q.Q4_0,
    "k_proj": Q.Q4_1,
    "v_proj": Q.Q8_0,
    "o_proj": Q.Q4_K,
    "gate_proj": Q.Q6_K,
    "up_proj": Q.Q4_1,
    "down_proj": Q.Q4_K,
    "embed_tokens": Q.Q8_0,
}
QWEN3_TYPES = {
    "q_proj": Q.Q8_0,
    "k_proj": Q.Q8_0,
    "v_proj": Q.Q8_0,
    "o_proj": Q.F16,
    "gate_proj": Q.Q4_0,
    "up_proj": Q.Q4_0,
    "down_proj": Q.Q6_K,
    "embed_tokens": Q.Q4_1,
    "lm_head": Q.Q6_K,
}
# the block types with a fifth bit (Q5_0/Q5_1 from gguf's quantizer), the 2-, 3- and 5-bit K-quants and the
# non-linear IQ4_NL / IQ4_XS (random blocks)
QWEN2_TYPES = {
    "q_proj": Q.Q5_0,
    "k_proj": Q.Q5_1,
    "v_proj": Q.Q3_K,
    "o_proj": Q.Q5_K,
    "gate_proj": Q.Q2_K,
    "up_proj": Q.IQ4_XS,
    "down_proj": Q.Q3_K,
    "embed_tokens": Q.IQ4_NL,
    "lm_head": Q.Q5_0,
}
# the experts' block types (their 3-D tensors), the router stays float32
MOE_TYPES = {**QWEN3_TYPES, "gate_exps": Q.Q4_K, "up_exps": Q.Q8_0, "down_exps": Q.Q6_K}
MIXTRAL_TYPES = {
    **LLAMA_TYPES,
    "lm_head": Q.Q8_0,
    "gate_exps": Q.Q4_0,
    "up_exps": Q.Q4_0,
    "down_exps": Q.Q5_K,
}
_MOE = {"num_experts_per_tok": 2}
_HF_TYPES = {"qwen3moe": "qwen3_moe", "MixtralForCausalLM": "mixtral"}  # where AutoConfig's name differs
_GGUF_NAMES = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "q_norm": "attn_q_norm",
    "k_norm": "attn_k_norm",
}
_LLAMA = {"vocab_size": 320, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
_QWEN3 = {"vocab_size": 300, "hidden_size": 256, "intermediate_size": 256, "head_dim": 96}
_QWEN2 = {"vocab_size": 290, "hidden_size": 256, "intermediate_size": 512}
_COMMON = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
SPECS = {
    "llama": ("LlamaForCausalLM", "llama", LLAMA_TYPES, {**_LLAMA, **_COMMON, "tie_word_embeddings": True}),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", QWEN3_TYPES, {**_QWEN3, **_COMMON, "tie_word_embeddings": False}),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", QWEN2_TYPES, {**_QWEN2, **_COMMON, "tie_word_embeddings": False}),
    # Llama 3.1's rope scaling, which llama.cpp writes as a rope_freqs tensor of per-frequency divisors
    "llama31": ("LlamaForCausalLM", "llama", LLAMA_TYPES, {**_LLAMA, **_COMMON, "tie_word_embeddings": True,
                "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    # mixtures of experts: Qwen3-MoE (qwen3moe) and Mixtral (a llama with experts), experts in three 3-D
    # tensors of one type each and the router in float32
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3moe", MOE_TYPES, {**_QWEN3, **_COMMON, "tie_word_embeddings": False,
                  **_MOE, "num_experts": 4, "moe_intermediate_size": 256, "norm_topk_prob": True}),
    "mixtral": ("MixtralForCausalLM", "llama", MIXTRAL_TYPES, {**_LLAMA, **_COMMON, **_MOE,
                "tie_word_embeddings": False, "num_local_experts": 5}),
    # YaRN as llama.cpp's converter writes it: rope.scaling.* metadata keys
    "qwen2_yarn": ("Qwen2ForCausalLM", "qwen2", QWEN2_TYPES, {**_QWEN2, **_COMMON, "tie_word_embeddings": False,
                   "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "beta_fast": 16.0,
                                       "original_max_position_embeddings": 32}}),
}  # fmt: skip


def _llama_cpp_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf for a llama3 rope scaling: each frequency's divisor."""
    import math

    low, high, old = (
        rope["low_freq_factor"],
        rope["high_freq_factor"],
        rope["original_max_position_embeddings"],
    )
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(rope["factor"])
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.asarray(factors, dtype=np.float32)


def _blocks(w: torch.Tensor, qtype: Q, seed: int) -> np.ndarray:
    """The rows of w as blocks of qtype: gguf's quantizer where it has one, else random blocks whose
    fp16 scales are set so the weights have w's spread."""
    scale_at = {Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.IQ4_NL: [0],
                Q.IQ4_XS: [0]}.get(qtype)  # fmt: skip
    if scale_at is None:
        return gguf.quants.quantize(w.numpy(), qtype)
    rng = np.random.default_rng(seed)
    n, k = w.shape
    size, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n * k // size, nbytes), dtype=np.uint8)
    for off in scale_at:
        blocks[:, off : off + 2] = np.full((blocks.shape[0], 1), 1.0, np.float16).view(np.uint8)
    spread = gguf.quants.dequantize(blocks, qtype).std()
    for off in scale_at:
        d = rng.uniform(0.5, 1.5, size=(blocks.shape[0], 1)) * float(w.std()) / spread
        blocks[:, off : off + 2] = d.astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


def _llama_cpp_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (its interleaved rotary)."""
    return (
        rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")  # model.layers.{i}.{self_attn|mlp|norm}.{proj}.weight
    return f"blk.{parts[2]}.{_GGUF_NAMES[parts[-2]]}.{parts[-1]}"


def write_tiny_gguf(name: str, out_dir: str) -> tuple[str, str]:
    """A tiny random model as a .gguf file, and the HF directory of its dequantized weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    arch, gguf_arch, types, kwargs = SPECS[name]
    config = AutoConfig.for_model(
        _HF_TYPES.get(arch, _HF_TYPES.get(gguf_arch, gguf_arch)),
        initializer_range=0.15,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        architectures=[arch],
        **kwargs,
    )
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    writer = gguf.GGUFWriter(os.path.join(out_dir, f"{name}.gguf"), gguf_arch)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for key, value in [
        ("block_count", config.num_hidden_layers),
        ("context_length", 512),
        ("embedding_length", config.hidden_size),
        ("feed_forward_length", config.intermediate_size),
        ("attention.head_count", config.num_attention_heads),
        ("attention.head_count_kv", config.num_key_value_heads),
        ("attention.key_length", head_dim),
        ("rope.dimension_count", head_dim),
        ("vocab_size", config.vocab_size),
    ]:
        writer.add_uint32(f"{gguf_arch}.{key}", value)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:
        writer.add_uint32(f"{gguf_arch}.expert_count", experts)
        writer.add_uint32(f"{gguf_arch}.expert_used_count", config.num_experts_per_tok)
        ffn = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        writer.add_uint32(f"{gguf_arch}.expert_feed_forward_length", ffn)
    writer.add_float32(f"{gguf_arch}.rope.freq_base", float(config.rope_parameters["rope_theta"]))
    rope = config.rope_parameters
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama_cpp_rope_freqs(rope, head_dim))
    elif rope.get("rope_type") in ("linear", "yarn"):
        writer.add_string(f"{gguf_arch}.rope.scaling.type", rope["rope_type"])
        writer.add_float32(f"{gguf_arch}.rope.scaling.factor", rope["factor"])
        if rope["rope_type"] == "yarn":
            old_len = rope["original_max_position_embeddings"]
            writer.add_uint32(f"{gguf_arch}.rope.scaling.original_context_length", old_len)
            writer.add_float32(f"{gguf_arch}.rope.scaling.yarn_beta_fast", rope["beta_fast"])
    writer.add_float32(f"{gguf_arch}.attention.layer_norm_rms_epsilon", 1e-6)
    state = {}
    for i, (hf, w) in enumerate(model.state_dict().items()):
        if hf == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if ".experts." in hf:  # [E, out, in]: gate | up stacked in gate_up_proj, down_proj
            layer = hf.split(".")[2]
            pieces = w.chunk(2, dim=1) if hf.endswith("gate_up_proj") else (w,)
            kinds = ("gate_exps", "up_exps") if hf.endswith("gate_up_proj") else ("down_exps",)
            deq = []
            for j, (kind, t) in enumerate(zip(kinds, pieces)):
                blocks = _blocks(t.reshape(-1, t.shape[-1]), types[kind], seed=100 * i + j)
                deq.append(
                    torch.from_numpy(gguf.quants.dequantize(blocks, types[kind]).copy()).reshape(t.shape)
                )
                writer.add_tensor(f"blk.{layer}.ffn_{kind}.weight", blocks.reshape(*t.shape[:2], -1),
                                  raw_dtype=types[kind])  # fmt: skip
            state[hf] = torch.cat(deq, dim=1)
            continue
        if hf.endswith(".mlp.gate.weight"):  # the router, float32
            state[hf] = w
            writer.add_tensor(f"blk.{hf.split('.')[2]}.ffn_gate_inp.weight", w.numpy())
            continue
        kind = hf.split(".")[-2]
        if w.dim() == 1:
            state[hf], data, qtype = w, w.numpy(), None
        else:
            qtype = types[kind]
            blocks = _blocks(w, qtype, seed=i)
            state[hf] = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).copy()).reshape(w.shape)
            data = blocks
        if gguf_arch == "llama" and kind in ("q_proj", "k_proj"):
            heads = config.num_attention_heads if kind == "q_proj" else config.num_key_value_heads
            data = _llama_cpp_permute(data, heads)
        writer.add_tensor(_gguf_name(hf), data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.load_state_dict(state, strict=False)  # the weights as the file holds them
    if config.tie_word_embeddings:
        model.tie_weights()
    hf_dir = os.path.join(out_dir, f"{name}-hf")
    model.save_pretrained(hf_dir)
    return os.path.join(out_dir, f"{name}.gguf"), hf_dir


# torch attention runs the layers; cpu attention (where the C kernels build) the one-call decode step
ATTNS = ["torch", "cpu"] if cpu.decode_step_available() else ["torch"]


@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("name", list(SPECS))
def test_tiny_gguf_stored_equals_hf_on_the_dequantized_weights(name, attn, tmp_path):
    gguf_path, hf_dir = write_tiny_gguf(name, str(tmp_path))
    ref = HFReference(hf_dir)
    vocab = SPECS[name][3]["vocab_size"]
    # 7 rows take the stored kernels' panel path, then 4 rows (three leave) their dot path
    prompts = [random_prompt(n, vocab, seed=n) for n in (5, 17, 40, 23, 9, 31, 12)]
    sp = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 12, 12, 12, 4, 4, 4)]
    with make_llm(gguf_path, **tiny_llm_kwargs(weights_format="stored", attn=attn)) as llm:
        engine = llm.scheduler.engine
        moe = engine.model_config.moe is not None
        assert (engine.cpu_step is not None) == (attn == "cpu")  # stored experts in the C step too
        model = engine.model
        if moe:  # every expert's blocks as stored, the float stacks never allocated
            experts = model.model.layers[1].mlp.experts
            assert experts.stored is not None and not hasattr(experts, "w13")
            # the one-call C kernel where it builds, the reference loop over kernel.linear otherwise
            assert (experts.stored_desc is not None) == cpu.available()
        assert isinstance(model.model.layers[0].self_attn.qkv_proj.weight, StoredWeight)
        assert isinstance(model.lm_head.weight, StoredWeight)
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == SPECS[name][3][
            "tie_word_embeddings"
        ]
        if name in ("llama31", "qwen2_yarn"):  # the rope scaling read back from the file
            scaling = engine.model_config.rope_scaling
            assert {k: scaling[k] for k in SPECS[name][3]["rope_parameters"] if k != "rope_theta"} == {
                k: v for k, v in SPECS[name][3]["rope_parameters"].items() if k != "rope_theta"
            }
        # the blocks as stored are what stays resident (plus the float norms)
        assert engine.weight_bytes < os.path.getsize(gguf_path)
        outs = llm.generate(prompts, sp)
        prepared = engine.model_dir
    shutil.rmtree(prepared, ignore_errors=True)  # the cached config directory of this temporary file
    for suffix in (".lock",):
        if os.path.exists(prepared + suffix):
            os.unlink(prepared + suffix)
    for prompt, out, params in zip(prompts, outs, sp):
        assert len(out["token_ids"]) == params.max_tokens
        assert_tokens_equal_hf(out["token_ids"], ref, prompt, what=f"{name} stored")


def test_unsupported_block_type_is_named(tmp_path):
    """A projection in a type the kernels do not read: an error naming the type and the way out."""
    path = str(tmp_path / "iq2.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in [
        ("block_count", 1),
        ("context_length", 64),
        ("embedding_length", 256),
        ("feed_forward_length", 256),
        ("attention.head_count", 2),
        ("vocab_size", 32),
    ]:
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    raw = np.zeros((256, gguf.GGML_QUANT_SIZES[Q.IQ2_XXS][1]), np.uint8)
    writer.add_tensor("token_embd.weight", np.zeros((32, 256), np.float32))
    writer.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=Q.IQ2_XXS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from minisgl.llm import LLM

    with pytest.raises(ValueError, match="IQ2_XXS.*IQ4_XS.*--weights-format float32"):
        LLM(path, **tiny_llm_kwargs(weights_format="stored"))


QUICKSTART_PROMPTS = ["The capital of France is", "List three prime numbers:", "def fibonacci(n):"]


def test_default_model_stored_equals_hf_on_the_float32_conversion(default_model_dir):
    """The embedded default model (Q4_1 projections, Q8_0 tied embedding), stored: Hugging Face's greedy
    tokens on the converted float32 directory (the same dequantized values)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    ref = HFReference(default_model_dir)
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with make_llm(None, max_running_req=4, max_seq_len_override=512, show_progress=False) as llm:
        engine = llm.scheduler.engine
        assert engine.config.weights_format == "auto" and os.path.islink(
            os.path.join(engine.model_dir, "model.gguf")
        )
        assert engine.weight_bytes < 100 * 2**20  # 92 MiB of blocks instead of 513 MiB of float32
        # the per-rank memory report counts the same bytes: the blocks, beyond the float parameters
        assert llm.rank_states()[0]["memory"]["weights"] == engine.weight_bytes
        assert engine.weight_bytes > 50 * 2**20  # the float parameters alone are the norms' few KB
        outs = llm.generate(QUICKSTART_PROMPTS, sp)
    for prompt, out in zip(QUICKSTART_PROMPTS, outs):
        ids = tokenizer(prompt)["input_ids"]
        assert_tokens_equal_hf(out["token_ids"], ref, ids, what=repr(prompt))


@pytest.mark.parametrize("half", ["bfloat16", "float16"])
def test_half_safetensors_stored_equals_hf(half, tmp_path):
    """A bf16/fp16 checkpoint with weights_format="stored" keeps its matrices in half precision (half the
    bytes) and gives Hugging Face float32's tokens on the same (exactly upcast) weights."""
    from helpers import TINY_SPECS, build_tiny_model
    from transformers import AutoModelForCausalLM

    src = build_tiny_model(TINY_SPECS["qwen3"], str(tmp_path / "f32"))
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.to(getattr(torch, half)).save_pretrained(str(tmp_path / half))
    ref = HFReference(str(tmp_path / half))
    prompts = [random_prompt(n, 1000, seed=n) for n in (6, 30)]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with make_llm(str(tmp_path / half), **tiny_llm_kwargs(weights_format="stored")) as llm:
        engine = llm.scheduler.engine
        w = engine.model.model.layers[0].mlp.down_proj.weight
        assert isinstance(w, StoredWeight) and w.nbytes == w.shape[0] * w.shape[1] * 2
        outs = llm.generate(prompts, sp)
    for prompt, out in zip(prompts, outs):
        assert_tokens_equal_hf(out["token_ids"], ref, prompt, what=f"{half} stored")


def test_gguf_dequantized_into_float_parameters_equals_the_reference(tmp_path):
    """Where stored weights do not serve (a GPU, TP), the file is dequantized into the float parameters:
    exactly the weights Hugging Face holds (q/k rows back in HF order, QKV and gate|up merged)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from minisgl.models import ModelConfig, create_model
    from minisgl.models.stored_weights import load_gguf

    gguf_path, hf_dir = write_tiny_gguf("llama", str(tmp_path))
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict()
    model = create_model(ModelConfig.from_hf(AutoConfig.from_pretrained(hf_dir)))
    assert load_gguf(model, gguf_path, keep_stored=False, show_progress=False) == 0
    attn = model.model.layers[1].self_attn.qkv_proj.weight
    expected = torch.cat([hf[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(attn, expected)
    assert torch.equal(model.lm_head.weight, hf["model.embed_tokens.weight"])


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_gguf_experts_dequantized_into_float_parameters_equal_the_reference(name, tmp_path):
    """A GPU or TP dequantizes the experts' 3-D tensors into the stacked float parameters: exactly HF's
    gate | up and down stacks, and its router."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from minisgl.models import ModelConfig, create_model
    from minisgl.models.stored_weights import load_gguf

    gguf_path, hf_dir = write_tiny_gguf(name, str(tmp_path))
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict()
    model = create_model(ModelConfig.from_hf(AutoConfig.from_pretrained(hf_dir)))
    assert load_gguf(model, gguf_path, keep_stored=False, show_progress=False) == 0
    mlp = model.model.layers[1].mlp
    assert mlp.experts.stored is None
    assert torch.equal(mlp.experts.w13, hf["model.layers.1.mlp.experts.gate_up_proj"])
    assert torch.equal(mlp.experts.w2, hf["model.layers.1.mlp.experts.down_proj"])
    assert torch.equal(mlp.gate.weight, hf["model.layers.1.mlp.gate.weight"])


def test_stored_experts_on_the_fused_moe_backend_are_refused_by_name(tmp_path):
    pytest.importorskip("triton")
    gguf_path, _ = write_tiny_gguf("qwen3_moe", str(tmp_path))
    with (
        pytest.raises(ValueError, match="stored run on the torch MoE backend"),
        make_llm(gguf_path, **tiny_llm_kwargs(weights_format="stored", moe_backend="fused")),
    ):
        pass


def test_a_synthetic_q4_k_m_file_stored_equals_hf_on_its_float32_conversion(tmp_path):
    """A file as llama.cpp's Q4_K_M recipe writes it (Q4_K projections, Q6_K attn_v/ffn_down/output, the
    default model's tokenizer, Llama 3.2's rope scaling as a rope_freqs tensor), from the benchmark's
    generator at small shapes: read as stored, its greedy
    tokens are Hugging Face float32's on the file converted by gguf.quants (weights_format="float32")."""
    from minisgl.benchmark import synth_gguf

    path = str(tmp_path / "q4km.gguf")
    synth_gguf.main([path, "--hidden", "256", "--intermediate", "512", "--layers", "2", "--heads", "4",
                     "--kv-heads", "2", "--rope-freqs"])  # fmt: skip
    prompts = [random_prompt(n, 49152, seed=n) for n in (7, 26)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    dirs = []
    with make_llm(path, **tiny_llm_kwargs(weights_format="float32")) as llm:
        dirs.append(llm.scheduler.engine.model_dir)
    with make_llm(path, **tiny_llm_kwargs(weights_format="stored", attn=ATTNS[-1])) as llm:
        engine = llm.scheduler.engine
        layer = engine.model.model.layers[1]
        types = {p.ggml_type for p in layer.self_attn.qkv_proj.weight.parts}
        assert types == {Q.Q4_K, Q.Q6_K} and layer.mlp.down_proj.weight.parts[0].ggml_type == Q.Q6_K
        outs = llm.generate(prompts, sp)
        dirs.append(engine.model_dir)
    ref = HFReference(dirs[0])
    for prompt, out in zip(prompts, outs):
        assert_tokens_equal_hf(out["token_ids"], ref, prompt, what="Q4_K_M stored")
    # Llama 3.2's rope scaling, from the file's rope_freqs, in both the conversion and the stored model
    rope = ref.model.config.rope_parameters
    got = (rope.get("rope_type"), rope.get("factor"), rope.get("original_max_position_embeddings"))
    assert got == ("llama3", 32.0, 8192), f"the float32 conversion's rope: {rope}"
    assert engine.model_config.rope_scaling["rope_type"] == "llama3"
    for d in dirs:  # the prepared directories of this temporary file
        shutil.rmtree(d, ignore_errors=True)
        if os.path.exists(d + ".lock"):
            os.unlink(d + ".lock")


def test_a_synthetic_qwen3_moe_file_stored_equals_hf_on_its_float32_conversion(tmp_path):
    """A Qwen3-MoE file in llama.cpp's layout (`qwen3moe`: Q4_K experts with Q6_K down projections, a
    float32 router, the default model's tokenizer) from the benchmark's generator: read as stored, its
    greedy tokens are Hugging Face float32's on the file converted through transformers, whose GGUF reader
    leaves out the expert width and the renormalised routing (the conversion puts them back)."""
    from minisgl.benchmark import synth_gguf

    path = str(tmp_path / "moe.gguf")
    synth_gguf.main([path, "--hidden", "256", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--experts",
                     "6", "--experts-used", "2", "--expert-intermediate", "256"])  # fmt: skip
    prompts = [random_prompt(n, 49152, seed=n) for n in (5, 23)]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    dirs = []
    with make_llm(path, **tiny_llm_kwargs(weights_format="float32")) as llm:
        dirs.append(llm.scheduler.engine.model_dir)
        converted = llm.generate(prompts, sp)
    with make_llm(path, **tiny_llm_kwargs(weights_format="stored", attn=ATTNS[-1])) as llm:
        experts = llm.scheduler.engine.model.model.layers[1].mlp.experts
        assert experts.stored is not None
        assert {p.ggml_type for p in experts.stored[0][0].parts} == {Q.Q4_K}
        assert experts.stored[1][0].parts[0].ggml_type == Q.Q6_K
        outs = llm.generate(prompts, sp)
        dirs.append(llm.scheduler.engine.model_dir)
    ref = HFReference(dirs[0])
    assert ref.model.config.moe_intermediate_size == 256 and ref.model.config.norm_topk_prob
    for prompt, out, conv in zip(prompts, outs, converted):
        assert_tokens_equal_hf(out["token_ids"], ref, prompt, what="Qwen3-MoE stored")
        assert_tokens_equal_hf(conv["token_ids"], ref, prompt, what="Qwen3-MoE converted")
    for d in dirs:  # the prepared directories of this temporary file
        shutil.rmtree(d, ignore_errors=True)
        if os.path.exists(d + ".lock"):
            os.unlink(d + ".lock")


def test_rope_freqs_that_match_no_llama3_scaling_are_refused(tmp_path):
    """A rope_freqs tensor no llama3 rope scaling produces: an error naming it, not a silent guess."""
    from minisgl.gguf.config import hf_config
    from minisgl.gguf.reader import open_gguf

    path = str(tmp_path / "odd-rope.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in [("block_count", 1), ("context_length", 64), ("embedding_length", 64),
                       ("feed_forward_length", 64), ("attention.head_count", 2), ("vocab_size", 32)]:  # fmt: skip
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_tensor("token_embd.weight", np.zeros((32, 64), np.float32))
    writer.add_tensor("rope_freqs.weight", np.linspace(1.0, 3.0, 16, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="rope_freqs.weight matches no llama3 rope scaling"):
        hf_config(open_gguf(path))


def _rope_only_gguf(path: str, keys: dict) -> str:
    """A one-tensor llama file with the given rope.scaling metadata (strings, floats or ints)."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("llama.attention.head_count", 2)
    for key, value in keys.items():
        add = {str: writer.add_string, float: writer.add_float32, int: writer.add_uint32}[type(value)]
        add(f"llama.rope.scaling.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((32, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "keys,expected",
    [
        ({"type": "none"}, None),
        ({"type": "linear", "factor": 2.5}, {"rope_type": "linear", "factor": 2.5}),
        (
            {"type": "yarn", "factor": 4.0, "original_context_length": 4096, "yarn_attn_factor": 1.25,
             "yarn_beta_slow": 2.0, "yarn_ext_factor": 1.0, "attn_factor": 1.0},
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
             "attention_factor": 1.25, "beta_slow": 2.0},
        ),
        ({"type": "longrope", "factor": 2.0}, "rope scaling type 'longrope' is not supported"),
        ({"type": "yarn", "factor": 4.0}, "no llama.rope.scaling.original_context_length"),
        ({"type": "linear"}, "has no llama.rope.scaling.factor"),
        ({"type": "yarn", "factor": 4.0, "original_context_length": 64, "yarn_log_multiplier": 0.1},
         r"yarn_log_multiplier = 0.1\d* is not supported"),
        ({"type": "linear", "factor": 2.0, "attn_factor": 0.5}, "attn_factor = 0.5 is not supported"),
    ],
)  # fmt: skip
def test_rope_scaling_metadata_becomes_the_hf_rope_scaling_or_is_refused_by_name(keys, expected, tmp_path):
    """llama.cpp's rope.scaling keys: linear and YaRN become HF's rope scaling (YaRN's attention factor and
    betas by their HF names); another type, a missing factor or context length, or a key that would
    change the rotation beyond HF's config is an error naming it."""
    from minisgl.gguf.config import rope_scaling
    from minisgl.gguf.reader import open_gguf

    reader = open_gguf(_rope_only_gguf(str(tmp_path / "rope.gguf"), keys))
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            rope_scaling(reader, 64, 1e4)
    else:
        assert rope_scaling(reader, 64, 1e4) == expected


def test_the_float32_conversion_keeps_the_files_rope_scaling(tmp_path):
    """transformers' GGUF reader drops rope scaling: the conversion puts the file's back into the config
    it saves (YaRN from metadata keys here, Llama 3's rope_freqs in the Q4_K_M test above)."""
    from transformers import AutoConfig

    from minisgl.gguf.config import complete_config
    from minisgl.gguf.reader import open_gguf

    gguf_path, hf_dir = write_tiny_gguf("qwen2_yarn", str(tmp_path))
    config = AutoConfig.from_pretrained(hf_dir)
    expected = dict(config.rope_parameters)
    config.rope_parameters = {"rope_theta": expected["rope_theta"], "rope_type": "default"}
    complete_config(open_gguf(gguf_path), config)
    assert {k: v for k, v in config.rope_parameters.items() if v is not None} == {
        k: v for k, v in expected.items() if v is not None
    }


def test_the_cache_is_keyed_by_the_files_contents(tmp_path, monkeypatch):
    """The same file at another path (another virtual environment, a reinstall) finds the prepared
    directory instead of adding one, and its link follows the file; other contents get their own."""
    from minisgl.gguf.model_dir import GGUF_LINK
    from minisgl.models.resolve import resolve_model_path

    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path / "cache"))
    first, _ = write_tiny_gguf("llama", str(tmp_path))
    second = str(tmp_path / "elsewhere" / "llama.gguf")
    os.makedirs(os.path.dirname(second))
    shutil.copy(first, second)
    prepared = resolve_model_path(first, weights_format="stored")
    os.remove(first)
    assert resolve_model_path(second, weights_format="stored") == prepared
    assert os.path.realpath(os.path.join(prepared, GGUF_LINK)) == os.path.realpath(second)
    assert len(os.listdir(os.path.join(tmp_path, "cache", "gguf"))) == 2  # the directory and its lock

    # one byte changed at the end (the last tensor's data): another key
    third = str(tmp_path / "changed.gguf")
    shutil.copy(second, third)
    with open(third, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    assert resolve_model_path(third, weights_format="stored") != prepared
