# Hand-check one row: our collate's DSpark labels, gold prev tokens and teacher rows against
# DeepSpec's formulas (label = anchor + 1..B, teacher row = label - 1, prev = [anchor, labels[:-1]],
# eval_mask cumprod), written out here by hand.
import torch
from dflash_train import contract
from dflash_train.data.dataset import build_example
from dflash_train.training.dspark_loss import previous_tokens, teacher_index
B, MASK = 4, 99
x = torch.tensor([10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21])
lm = torch.tensor([0, 0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1])  # prompt 0..2, answer 3..6, hole at 7, answer 8..11
cands = contract.anchor_candidates(lm, kind=contract.DSPARK)
print("our anchor candidates", cands.tolist())
# DeepSpec: p < T-1 with lm[p] and lm[p+1]
ds_c = [p for p in range(len(x) - 1) if lm[p] and lm[p + 1]]
print("DeepSpec candidates  ", ds_c)
anchors = cands
ex = build_example(x, lm, None, anchors, block_size=B, mask_token_id=MASK, kind=contract.DSPARK)
labels = ex["labels"]
print("block_ids\n", ex["block_ids"])
print("block positions\n", ex["block_position_ids"])
print("labels\n", labels)
# DeepSpec by hand
T = len(x)
for n, p in enumerate(anchors.tolist()):
    li = [p + k + 1 for k in range(B)]
    valid = [(i < T) and bool(lm[min(i, T - 1)]) for i in li]
    cum, ok = [], True
    for v in valid:
        ok = ok and v
        cum.append(ok)
    ds_lab = [int(x[i]) if c else -100 for i, c in zip(li, cum)]
    assert ds_lab == labels[n].tolist(), (p, ds_lab, labels[n].tolist())
lab = labels.flatten()[None]
bids = ex["block_ids"].flatten()[None]
prev = previous_tokens(lab, bids, B)[0].view(-1, B)
idx = (lab.flatten() != -100).nonzero().squeeze(1)
trow = teacher_index(idx, anchors[None], B, T)
print("prev\n", prev)
for j, i in enumerate(idx.tolist()):
    n, k = divmod(i, B)
    p = int(anchors[n])
    assert int(prev[n, k]) == int(x[p + k]), "prev must be x[p+k]"
    assert int(trow[j]) == p + k, "teacher row must be p+k (predicts x[p+k+1])"
    assert int(labels[n, k]) == int(x[p + k + 1])
print("OK: labels x[p+k+1], prev x[p+k], teacher row p+k, cumulative truncation: all as DeepSpec's")
