"""GPU: the paper's geometry trains in bf16 on one GPU (Qwen3-8B-shaped random target)."""

import functools
import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
# drafter.flex_backend=flash runs FlashAttention-4's kernels: an optional install
needs_flash = pytest.mark.skipif(
    importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("flash_attn.cute") is None,
    reason="needs FlashAttention-4 (pip install --pre flash-attn-4)")
# a target whose drafter has head_dim 128, GQA 2:1 (FlashAttention-4's Hopper kernels' home ground)
HEAD_DIM_128 = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 2, "num_key_value_heads": 1}


def test_qwen3_8b_geometry_trains_on_one_gpu_without_oom():
    from dflash_train import bench

    result = bench.main(["+experiment=qwen3_8b_8xh100", "backend=single", "optim.grad_accum_steps=1",
                         "bench.random_target=true", "bench.steps=3", "bench.warmup=2"])
    assert result["seq_len"] == 3072 and result["queries_per_row"] == 512 * 16
    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    assert result["peak_memory_gib"] < 0.9 * total_gib
    assert math.isfinite(result["samples_per_s"]) and result["samples_per_s"] > 0
    # the mask is built from the problem's structure: a small share of the step
    assert result["phase_ms"]["mask_build"] < 0.02 * sum(result["phase_ms"].values())


def _random_conversations(out_dir, vocab: int, count: int = 24):
    """A datagen folder of random conversations of 20-90 tokens (no tokenizer needed: the GPU
    image lacks the embedded SmolLM2 package)."""
    from dflash_train.data import format as data_format

    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(count):
        n, p = int(torch.randint(20, 90, (1,), generator=g)), int(torch.randint(4, 12, (1,), generator=g))
        rows.append({"input_ids": torch.randint(0, vocab, (n,), generator=g).tolist(),
                     "loss_mask": [0] * p + [1] * (n - p), "prompt_id": f"p{i}", "source": "test",
                     "finish_reason": "stop", "prompt_len": p, "response_len": n - p, "num_tokens": n})
    data_format.write_shard(out_dir, 0, rows, {})
    data_format.consolidate(out_dir, range(1), {"format_version": data_format.FORMAT_VERSION, "counts": {"rows": count}})
    return out_dir


@pytest.mark.parametrize("flex_backend", ["triton", pytest.param("flash", marks=needs_flash)])
def test_packed_flex_rows_compile_once_on_gpu(tmp_path, flex_backend):
    """The GPU path of the CPU no-recompilation test: flex attention compiled, with backward,
    and the target's layers compiled (packed rows: SDPA with the document mask); with either
    backend of the flex kernels."""
    from torch._dynamo.utils import counters

    from dflash_train.training.trainer import Trainer
    from tests.conftest import make_tiny_target
    from tests.train_data import tiny_train_config

    make_tiny_target("llama", vocab=97, **(HEAD_DIM_128 if flex_backend == "flash" else {})).save_pretrained(
        tmp_path / "target")
    data = _random_conversations(tmp_path / "data", vocab=97)
    cfg = tiny_train_config(
        str(tmp_path / "target"), data, tmp_path / "run",
        target={"mask_token_id": 96, "num_layers": 6, "compile": True},
        drafter={"compile": True, "attention": "flex", "num_hidden_layers": 2, "flex_backend": flex_backend},
        data={"packing": True, "max_length": 256, "num_anchors": 6, "blocks_per_row": 24, "val_rows": 5,
              "check_manifest": False},
        optim={"micro_batch_size": 2, "grad_accum_steps": 1},
        backend={"name": "single", "device": "cuda"},
    )
    torch._dynamo.reset()
    trainer = Trainer(cfg)
    # The target is loaded on the CPU and moved: dtype=auto must still mean bfloat16 on the GPU.
    assert {p.dtype for p in trainer.target.model.parameters()} == {torch.bfloat16}
    trainer.train_step(0)
    trainer.validate()
    warm = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(1, 5):
            assert trainer.train_step(step)["finite"]
        trainer.validate()
    assert counters["stats"]["unique_graphs"] == warm


@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("kernels", [None, pytest.param({"BACKEND": "FLASH"}, marks=needs_flash)],
                         ids=["triton", "flash"])
def test_compiled_flex_kernels_attend_like_the_dense_mask(kernels, docs):
    """The compiled flex kernels (either backend) on the DFlash training mask, with contexts of
    several 128-key tiles (full tiles skip mask_mod), short packed documents, GQA and d=128:
    output and gradients equal float32 SDPA under the dense mask of the same rule."""
    from torch.nn.attention.flex_attention import flex_attention

    from dflash_train.model.dflash import visible_mask
    from dflash_train.model.masks import build_block_mask

    torch.manual_seed(0)
    ctx, n, block, heads, kv_heads, d = 1000, 48, 16, 4, 2, 128
    anchors = torch.randperm(ctx - block)[:n].sort().values[None].cuda()
    doc_ids = (torch.arange(ctx) // 170)[None].cuda() if docs else None
    q = torch.randn(1, heads, n * block, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, ctx + n * block, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    grad_out = torch.randn_like(q)
    attend = torch.compile(functools.partial(flex_attention, block_mask=build_block_mask(anchors, ctx, block, doc_ids),
                                             scale=d**-0.5, enable_gqa=True, kernel_options=kernels))
    out = attend(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref_in = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, attn_mask=visible_mask(anchors, ctx, block, doc_ids),
                                         scale=d**-0.5, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, ref_in, grad_out.float())
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    for name, g, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g.float(), r, atol=3e-2, rtol=3e-2, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("max_norm", [0.05, 1e3])  # clipping active / inactive
def test_clipping_inside_the_fused_adamw_step_equals_clip_then_step(max_norm):
    """On CUDA the single backend hands the clip to fused AdamW as its gradient divisor;
    two steps must match torch's clip_grad_norm_ followed by a plain AdamW step."""
    from dflash_train.config import OptimConfig
    from dflash_train.distributed.build import build_backend
    from dflash_train.training.optim import optimizer_factory

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda()
    ref = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda()
    ref.load_state_dict(model.state_dict())
    backend = build_backend({"name": "single", "device": "cuda", "mixed_precision": "none"})
    backend.setup(model, optimizer_factory(OptimConfig(lr=1e-2)), None, clip_grad_norm=max_norm, grad_accum_steps=1)
    assert backend._clip_in_step  # the fused path is what this test is about
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                foreach=False)
    x = torch.randn(32, 64, device="cuda")
    for _ in range(2):
        backend.backward(backend.model(x).square().mean() * 100, sync=True)
        norm = backend.step()
        ref_opt.zero_grad()
        (ref(x).square().mean() * 100).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ref_opt.step()
        assert norm == pytest.approx(float(ref_norm), rel=1e-5)
        assert norm > 0.05  # so max_norm=0.05 really clips
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_the_fused_step_skips_non_finite_updates_on_the_device():
    """The fused step never waits before queuing the update: a NaN gradient or a NaN loss
    must still leave weights, moments, step counters and the schedule exactly as they were."""
    from dflash_train.config import OptimConfig
    from dflash_train.distributed.build import build_backend
    from dflash_train.training.optim import optimizer_factory, scheduler_factory

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)).cuda()
    backend = build_backend({"name": "single", "device": "cuda", "mixed_precision": "none"})
    cfg = OptimConfig(lr=1e-2, warmup_ratio=0.5)
    backend.setup(model, optimizer_factory(cfg), scheduler_factory(cfg, 10), clip_grad_norm=1.0, grad_accum_steps=1)
    assert backend._clip_in_step
    x = torch.randn(8, 16, device="cuda")
    backend.backward(backend.model(x).square().mean(), sync=True)
    assert math.isfinite(backend.step())  # one real update: moments and counters exist

    def snapshot():
        state = [{k: v.clone() for k, v in backend.optimizer.state[p].items()} for p in model.parameters()]
        return [p.detach().clone() for p in model.parameters()], state, backend.lr()

    before = snapshot()
    for poison in ("gradient", "loss"):
        loss = backend.model(x).square().mean()
        backend.backward(loss * float("nan") if poison == "gradient" else loss, sync=True)
        norm = backend.step(loss=torch.tensor(float("nan"), device="cuda") if poison == "loss" else None)
        assert math.isnan(norm), poison
        assert all(p.grad is None for p in model.parameters())  # gradients dropped
        after = snapshot()
        assert after[2] == before[2]  # the schedule did not move
        for a, b in zip(after[0], before[0]):
            assert torch.equal(a, b), poison
        for sa, sb in zip(after[1], before[1]):
            for k in sb:
                assert torch.equal(sa[k], sb[k]), (poison, k)
    backend.backward(backend.model(x).square().mean(), sync=True)
    assert math.isfinite(backend.step()) and backend.lr() != before[2]  # and training goes on
