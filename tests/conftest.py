"""Tiny random Hugging Face checkpoints, built once per session with transformers."""
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Eight simulated CPU devices for the multi-device tests (set before JAX starts; the other tests
# use the first device, as a one-device machine would).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()


def _fast_cpu_compile_flags() -> list[str]:
    """The tests compile far more than they compute (tiny models, a program per bucket): XLA's CPU
    backend without its fusion emitters and without LLVM's optimisations compiles a step about 4x
    faster. Only on a machine without an NVIDIA GPU (the GPU check runs the kernel tests
    compiled) and only on the jaxlib versions known to have these flags (XLA aborts on an
    unknown one); JAXENGINE_TEST_FAST_COMPILE=0 turns them off."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        known = version("jaxlib").startswith("0.10.")
    except PackageNotFoundError:
        known = False
    if not known or os.path.exists("/dev/nvidiactl") or os.environ.get("JAXENGINE_TEST_FAST_COMPILE") == "0":
        return []
    return ["--xla_cpu_use_fusion_emitters=false", "--xla_backend_optimization_level=0"]


FAST_CPU_COMPILE_FLAGS = _fast_cpu_compile_flags()       # subprocesses with an XLA_FLAGS of their own add them
_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join([_flags] + [f for f in FAST_CPU_COMPILE_FLAGS if f.split("=")[0] not in _flags])

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3)

VARIANTS = {
    "llama": ("llama", {}),
    "llama-gqa4-tied": ("llama", dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)),
    "llama3-rope": ("llama", dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
                                                   "rope_theta": 500000.0})),
    "mistral-window": ("mistral", dict(sliding_window=7)),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", dict(head_dim=32)),
}

# Mixtures of experts: routing spread over several experts per prompt (initializer_range 0.3), a
# sliding window, Qwen2-MoE's shared expert with a dense layer among the sparse ones (its MLP
# stacks) and sliding layers among full ones, Qwen3-MoE's q/k norm and renormalised top-k,
# gpt-oss's attention and experts.
MOE_VARIANTS = {
    "mixtral-window": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=7)),
    "qwen2-moe-shared-dense": ("qwen2_moe", dict(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                                                 moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                                 mlp_only_layers=[1], use_sliding_window=True, sliding_window=6,
                                                 max_window_layers=3)),       # layers 0 and 2 slide
    "qwen3-moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, head_dim=32,
                                    norm_topk_prob=True)),
    # Sliding (window 7) and full layers alternating, sinks, biases everywhere, YaRN past a short
    # original context, and a SwiGLU limit low enough that the clamp acts.
    "gpt-oss": ("gpt_oss", dict(num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48,
                                head_dim=16, sliding_window=7, swiglu_limit=1.0,
                                rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "truncate": False,
                                                 "original_max_position_embeddings": 16, "rope_theta": 150000.0})),
}


# Qwen3.5: three Gated DeltaNet layers to one gated full-attention layer, twice over.
QWEN3_5 = ("qwen3_5_text", dict(num_hidden_layers=8, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                linear_key_head_dim=8, linear_value_head_dim=8))
# Qwen3.5-MoE: the same layers, each with 8 routed experts (3 chosen) and a gated shared expert.
QWEN3_5_MOE = ("qwen3_5_moe_text", {**QWEN3_5[1], "num_experts": 8, "num_experts_per_tok": 3,
                                    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48})

# Nemotron-H: Mamba-2, attention and squared-ReLU MLP blocks, one part each, in a pattern with no
# period shorter than the model (as NVIDIA's are); Mamba-2 heads in 2 groups sharing B and C.
NEMOTRON_H = ("nemotron_h", dict(layers_block_type=["linear_attention", "mlp", "linear_attention", "full_attention",
                                                    "mlp", "linear_attention", "full_attention", "mlp"],
                                 head_dim=16, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2,
                                 chunk_size=8, layer_norm_epsilon=1e-5))
# Nemotron-H with experts: its MLP blocks turned mixtures of 8 experts (2 chosen from the best of 2
# groups by a grouped sigmoid router), an ungated shared expert, the experts in a latent width.
NEMOTRON_H_MOE = ("nemotron_h", {**NEMOTRON_H[1], "layers_block_type": [
    "linear_attention", "moe", "linear_attention", "full_attention", "mlp", "linear_attention", "full_attention",
    "moe"], "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 48, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
    "moe_latent_size": 40})


# DeepSeek-V3: a dense first layer, then 8 routed experts in 4 groups (2 kept) and a shared one;
# latent attention with and without the query's low-rank step, the first with YaRN past a short
# original context and its softmax-scale correction.
DEEPSEEK = dict(num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, num_key_value_heads=4)
DEEPSEEK_VARIANTS = {
    "q-lora-yarn": dict(q_lora_rank=24, rope_parameters={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "mscale": 1.0,
        "mscale_all_dim": 0.707, "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 10000.0}),
    "no-q-lora": dict(q_lora_rank=None),
}


def make_deepseek_checkpoint(folder, variant: str, **overrides):
    """A tiny DeepSeek-V3 whose routers' score-correction biases are far from 0 (they change
    which experts are chosen)."""
    import torch

    hf = make_checkpoint(folder, "deepseek_v3", **{**DEEPSEEK, **DEEPSEEK_VARIANTS[variant], **overrides})
    torch.manual_seed(1)
    with torch.no_grad():
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.5)
    hf.save_pretrained(folder)
    return hf


def make_checkpoint(folder, model_type: str, **overrides):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():       # norms and biases away from 1 and 0, sinks as large as scores, so a mix-up shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith("sinks"):
                p.add_(torch.randn_like(p) * 1.5)
    model.save_pretrained(folder)
    return model


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_byte_tokenizer(folder) -> None:
    """A byte-level tokenizer with no merges (ids 0-255 are bytes), <|im_end|> = 256 (EOS) and
    <|im_start|> = 257, and a ChatML template: real text, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


def make_chat_checkpoint(folder):
    """A tiny Llama with the byte tokenizer (vocabulary 258, EOS 256)."""
    model = make_checkpoint(folder, "llama", vocab_size=258, eos_token_id=256, bos_token_id=257)
    save_byte_tokenizer(folder)
    return model


@pytest.fixture(scope="session", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    """(variant name, folder, the transformers model as the oracle)."""
    model_type, overrides = VARIANTS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, make_checkpoint(folder, model_type, **overrides)


@pytest.fixture(scope="session", params=sorted(MOE_VARIANTS))
def moe_checkpoint(request, tmp_path_factory):
    """(variant name, folder, the transformers model as the oracle) of a tiny mixture of experts."""
    model_type, overrides = MOE_VARIANTS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, make_checkpoint(folder, model_type, **overrides)


@pytest.fixture(scope="session")
def moe_chat_checkpoint(tmp_path_factory):
    """(folder, the transformers model) of a tiny Qwen3-MoE with the byte tokenizer."""
    folder = tmp_path_factory.mktemp("moe-chat")
    model_type, overrides = MOE_VARIANTS["qwen3-moe"]
    hf = make_checkpoint(folder, model_type, **{**overrides, "vocab_size": 258, "eos_token_id": 256,
                                                "bos_token_id": 257})
    save_byte_tokenizer(folder)
    return folder, hf


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory):
    """Folder of a tiny Llama with a byte tokenizer and a chat template."""
    folder = tmp_path_factory.mktemp("tiny-chat")
    make_chat_checkpoint(folder)
    return folder


def pytest_configure(config):
    """The oracle on one thread: its tiny models gain nothing from a second one, and with the
    suite's workers on every core a second one only contends (the e2e and models folders run
    about a fifth faster, measured on two cores)."""
    import torch

    torch.set_num_threads(1)
