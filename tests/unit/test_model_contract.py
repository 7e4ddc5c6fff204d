"""Contract sections 1 and 2 on tiny random targets: masks, leakage, training == inference."""

import pytest
import torch

from dflash_train.model.dflash import (
    ContextCache,
    DFlashConfig,
    DFlashDraftModel,
    default_target_layer_ids,
    visible_mask,
)
from dflash_train.model.masks import build_block_mask, build_training_masks, reference_mask
from dflash_train.model.target import TargetModel
from tests.conftest import make_tiny_target



@pytest.fixture(autouse=True)
def _no_grad():
    # per test, not at import: a module-level switch would leak into every later test
    with torch.no_grad():
        yield


def test_default_layer_ids_match_the_contract():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(30, 1) == [15]
    assert default_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]
    assert default_target_layer_ids(36, 3) == [1, 17, 33]


MASK_CASES = [
    # (context, anchors, block, packed docs, sliding window, causal block)
    (40, 3, 4, False, None, False),
    (35, 4, 4, True, None, False),
    (37, 3, 5, False, 6, True),
    (45, 4, 4, True, 9, True),
]


@pytest.mark.parametrize("ctx,n,block,docs,window,causal", MASK_CASES)
def test_dense_mask_equals_loop_reference(ctx, n, block, docs, window, causal):
    g = torch.Generator().manual_seed(ctx)
    anchors = torch.stack([torch.randperm(ctx - 1, generator=g)[:n].sort().values for _ in range(2)])
    doc_ids = (torch.arange(ctx) // 11)[None].repeat(2, 1) if docs else None
    dense = visible_mask(anchors, ctx, block, doc_ids, window, causal)
    assert torch.equal(dense, reference_mask(anchors, ctx, block, doc_ids, window, causal))


@pytest.mark.parametrize("ctx,n,block,docs,window,causal", MASK_CASES + [(300, 20, 16, True, None, False), (260, 17, 16, False, 40, True)])
def test_flex_block_mask_attends_like_the_dense_mask(ctx, n, block, docs, window, causal):
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(ctx)
    anchors = torch.stack([torch.randperm(ctx - 1, generator=g)[:n].sort().values for _ in range(2)])
    doc_ids = (torch.arange(ctx) // 37)[None].repeat(2, 1) if docs else None
    q = torch.randn(2, 2, n * block, 8, generator=g)
    k, v = torch.randn(2, 2, 2, ctx + n * block, 8, generator=g)
    dense = visible_mask(anchors, ctx, block, doc_ids, window, causal)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    flex = flex_attention(q, k, v, block_mask=build_block_mask(anchors, ctx, block, doc_ids, window, causal))
    torch.testing.assert_close(flex, expected, atol=1e-5, rtol=1e-5)


def test_mask_strictly_before_anchor_and_no_cross_block():
    anchors = torch.tensor([[5, 9]])
    m = visible_mask(anchors, 12, 4)[0, 0]  # (8, 20)
    assert m[0, :5].all() and not m[0, 5:12].any()  # anchor 5 sees 0..4, never itself
    assert m[4, :9].all() and not m[4, 9:12].any()
    assert m[:4, 12:16].all() and not m[:4, 16:].any()  # own block only
    assert m[4:, 16:].all() and not m[4:, 12:16].any()


def _drafter(target, layers=2, block=4, **overrides):
    torch.manual_seed(1)
    cfg = DFlashConfig.from_target(target.config, mask_token_id=target.config.vocab_size - 1,
                                   num_hidden_layers=layers, block_size=block, **overrides)
    return DFlashDraftModel(cfg).eval()


def _training_inputs(target, drafter, ids, anchors):
    """The concatenated-blocks training forward for one row: outputs (1, N*B, H)."""
    tm = TargetModel(target)
    feats = tm.features(ids, drafter.target_layer_ids)  # (1, T, n*H)
    block = drafter.block_size
    blocks = torch.full((1, anchors.numel() * block), drafter.mask_token_id)
    blocks[0, ::block] = ids[0, anchors[0]]
    positions = torch.cat([torch.arange(ids.shape[1])[None], (anchors[..., None] + torch.arange(block)).view(1, -1)], 1)
    return feats, tm.embed_tokens(blocks), positions


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("kind", ["flex", "dense"])
def test_training_forward_equals_inference_forward(arch, kind):
    target = make_tiny_target(arch)
    drafter = _drafter(target)
    ids = torch.randint(0, 90, (1, 30))
    anchors = torch.tensor([[3, 11, 12, 25]])
    feats, noise, positions = _training_inputs(target, drafter, ids, anchors)
    masks = build_training_masks(drafter.config, anchors, torch.ones_like(anchors, dtype=torch.bool), 30, kind=kind)
    train_out = drafter(noise, feats, positions, masks)  # (1, N*B, H)
    block = drafter.block_size
    for j, p in enumerate(anchors[0].tolist()):
        # inference: context cache of positions 0..p-1, then the block at p..p+B-1
        cache = ContextCache()
        pos = torch.arange(0, p + block)[None]
        infer = drafter(noise[:, j * block:(j + 1) * block], feats[:, :p], pos, None, cache, True)
        torch.testing.assert_close(train_out[:, j * block:(j + 1) * block], infer, atol=2e-5, rtol=1e-4)
        assert all(k.shape[-2] == p for k in cache.keys)  # only context K/V are cached


def test_sliding_layers_training_equals_inference():
    target = make_tiny_target("qwen3")
    drafter = _drafter(target, layers=2, block=6, layer_types=["sliding_attention", "full_attention"],
                       sliding_window=5, use_sliding_window=True)
    assert drafter.layer_types == ["sliding_attention", "full_attention"]
    ids = torch.randint(0, 90, (1, 24))
    anchors = torch.tensor([[2, 9, 17]])
    feats, noise, positions = _training_inputs(target, drafter, ids, anchors)
    masks = build_training_masks(drafter.config, anchors, torch.ones_like(anchors, dtype=torch.bool), 24, kind="flex")
    train_out = drafter(noise, feats, positions, masks)
    for j, p in enumerate(anchors[0].tolist()):
        pos = torch.arange(0, p + 6)[None]
        infer = drafter(noise[:, j * 6:(j + 1) * 6], feats[:, :p], pos, drafter.inference_masks(p, 6, "cpu"), ContextCache(), True)
        torch.testing.assert_close(train_out[:, j * 6:(j + 1) * 6], infer, atol=2e-5, rtol=1e-4)
    # a sliding layer is causal inside the block and windowed over the context
    only_sliding = _drafter(target, layers=1, block=6, layer_types=["sliding_attention"], sliding_window=5,
                            target_layer_ids=drafter.target_layer_ids,
                            use_sliding_window=True)
    masks = only_sliding.inference_masks(9, 6, "cpu")
    pos = torch.arange(15)[None]
    base = only_sliding(noise[:, :6], feats[:, :9], pos, masks, ContextCache(), True)
    later = noise[:, :6].clone()
    later[:, 3] += 1.0
    out = only_sliding(later, feats[:, :9], pos, masks, ContextCache(), True)
    torch.testing.assert_close(out[:, :3], base[:, :3], atol=0, rtol=0)
    assert not torch.allclose(out[:, 3:], base[:, 3:])
    far = feats[:, :9].clone()
    far[:, :5] += 5.0  # positions 0..4 are more than 5 back from every slot (9..14)
    torch.testing.assert_close(only_sliding(noise[:, :6], far, pos, masks, ContextCache(), True), base, atol=0, rtol=0)


def test_block_outputs_ignore_context_at_or_after_the_anchor():
    target = make_tiny_target("llama")
    drafter = _drafter(target)
    ids = torch.randint(0, 90, (1, 30))
    anchors = torch.tensor([[8, 20]])
    feats, noise, positions = _training_inputs(target, drafter, ids, anchors)
    masks = build_training_masks(drafter.config, anchors, torch.ones_like(anchors, dtype=torch.bool), 30)
    base = drafter(noise, feats, positions, masks)
    leaked = feats.clone()
    leaked[:, 8:] += 5.0  # features at and after the first anchor change
    out = drafter(noise, leaked, positions, masks)
    torch.testing.assert_close(out[:, :4], base[:, :4], atol=0, rtol=0)  # block 0: unchanged
    assert not torch.allclose(out[:, 4:], base[:, 4:])  # block 1 (anchor 20) sees positions 8..19
    visible = feats.clone()
    visible[:, 7] += 5.0  # the position right before the anchor is context and must matter
    assert not torch.allclose(drafter(noise, visible, positions, masks)[:, :4], base[:, :4])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_layer_ids_are_outputs_of_decoder_layers(arch):
    target = make_tiny_target(arch)
    tm = TargetModel(target)
    seen = {}
    layers = target.model.layers
    hooks = [layer.register_forward_hook(lambda m, i, o, k=k: seen.__setitem__(k, o[0] if isinstance(o, tuple) else o))
             for k, layer in enumerate(layers)]
    ids = torch.randint(0, 90, (1, 12))
    target(ids)
    for h in hooks:
        h.remove()
    feats = tm.features(ids, [0, 2, 4])
    torch.testing.assert_close(feats, torch.cat([seen[0], seen[2], seen[4]], -1), atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"target_layer_ids=\[1, 6\] but the target has 6 layers"):
        tm.features(ids, [1, 6])


def test_features_stop_after_the_last_needed_layer():
    target = make_tiny_target("llama")
    calls = []
    hooks = [layer.register_forward_hook(lambda m, i, o, k=k: calls.append(k)) for k, layer in enumerate(target.model.layers)]
    TargetModel(target).features(torch.randint(0, 90, (1, 8)), [1, 2])
    for h in hooks:
        h.remove()
    assert calls == [0, 1, 2]


def test_last_layer_id_matches_hidden_states_semantics():
    target = make_tiny_target("llama")
    ids = torch.randint(0, 90, (1, 8))
    hs = target(ids, output_hidden_states=True).hidden_states
    feats = TargetModel(target).features(ids, [5])
    torch.testing.assert_close(feats, hs[6], atol=0, rtol=0)  # HF's last entry is after the final norm


@pytest.mark.parametrize("kind", ["flex", "dense"])
def test_training_masks_take_the_block_size_the_drafter_takes(kind):
    # a config whose dflash_config names the block size: the drafter reads it there, and so
    # must the masks, or the training masks would cut blocks of 16 where the drafter has 4
    config = DFlashConfig(dflash_config={"block_size": 4, "target_layer_ids": [1], "mask_token_id": 0},
                          hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                          intermediate_size=16, num_hidden_layers=1, vocab_size=10)
    assert config.block_size == 16 and DFlashDraftModel(config).block_size == 4
    anchors = torch.tensor([[0, 5]])
    masks = build_training_masks(config, anchors, torch.ones_like(anchors, dtype=torch.bool), 10, kind=kind)
    (mask,) = masks.values()
    if kind == "dense":
        assert torch.equal(mask, reference_mask(anchors, 10, 4))
    else:  # (queries: 2 blocks of 4, keys: 10 context + the 8 block tokens)
        assert mask.seq_lengths == (2 * 4, 10 + 2 * 4)
