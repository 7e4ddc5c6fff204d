# Toy of DSpark's slot 0: a backbone that must learn a context-dependent map (like DFlash's
# slot 1) plus a low-rank Markov head over the previous token (an easy lookup), trained with
# DeepSpec's loss mixes. Greedy labels (argmax of the teacher), teacher probabilities at T=1 for L1.
import sys, torch, torch.nn.functional as F
torch.set_num_threads(1)
V, H, Fd, R, BS, STEPS = 2048, 64, 64, 32, 256, int(sys.argv[1]) if len(sys.argv) > 1 else 800
g = torch.Generator().manual_seed(0)
U = torch.randn(V, H, generator=g) / H**0.5 * 3          # frozen "lm_head"
M = torch.randn(H, Fd, generator=g) / Fd**0.5            # context -> target hidden (what the backbone must learn)
A1, A2 = torch.randn(V, 16, generator=g), torch.randn(V, 16, generator=g)
zipf = 1.0 / torch.arange(1, V + 1).float() ** 1.1
BIG = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
SHARP = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0
def batch(n, gen):
    prev = torch.multinomial(zipf, n, replacement=True, generator=gen)
    ctx = torch.randn(n, Fd, generator=gen)
    tl = U @ torch.tanh(M @ ctx.T) * 1.0          # (V, n) context part
    tl = SHARP * (tl.T + BIG * (A1[prev] @ A2.T) / 4)  # bigram part, sharpened
    return prev, ctx, tl
class Drafter(torch.nn.Module):
    def __init__(s, markov):
        super().__init__()
        s.bb = torch.nn.Sequential(torch.nn.Linear(Fd, 256), torch.nn.GELU(), torch.nn.Linear(256, H))
        s.markov = markov
        if markov:
            s.w1 = torch.nn.Embedding(V, R); s.w2 = torch.nn.Linear(R, V, bias=False)
            for p in (s.w1.weight, s.w2.weight): torch.nn.init.normal_(p, std=0.02)
    def forward(s, prev, ctx):
        base = s.bb(ctx) @ U.T
        return base, (base + s.w2(s.w1(prev)) if s.markov else base)
def run(ce_a, l1_a, markov, lr=1.5e-3, seed=1):
    torch.manual_seed(seed)
    m = Drafter(markov); opt = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed); ev = torch.Generator().manual_seed(123)
    eprev, ectx, etl = batch(4096, ev); ey = etl.argmax(-1)
    out = []
    for step in range(1, STEPS + 1):
        warm = min(1.0, step / (0.04 * STEPS)); 
        for gr in opt.param_groups: gr["lr"] = lr * warm
        prev, ctx, tl = batch(BS, gen); y = tl.argmax(-1)
        base, z = m(prev, ctx)
        loss = ce_a * F.cross_entropy(z, y)
        if l1_a: loss = loss + l1_a * (z.softmax(-1) - tl.softmax(-1)).abs().sum(-1).mean()
        opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0); opt.step()
        if step in (100, 200, 400, 800, 1600, 3200):
            with torch.no_grad():
                b, z = m(eprev, ectx)
                acc = (z.argmax(-1) == ey).float().mean().item()
                tv = 1 - 0.5 * (z.softmax(-1) - etl.softmax(-1)).abs().sum(-1).mean().item()
                bacc = (b.argmax(-1) == ey).float().mean().item()
            out.append(f"{step}: acc {acc:.3f} accept {tv:.3f} bb-only {bacc:.3f}")
    return out
with torch.no_grad():
    p, c, tl = batch(8192, torch.Generator().manual_seed(5)); y = tl.argmax(-1)
    big_only = (SHARP * BIG * (A1[p] @ A2.T) / 4).argmax(-1); ctx_only = (U @ torch.tanh(M @ c.T)).T.argmax(-1)
    print(f"teacher: bigram-only acc {(big_only == y).float().mean():.3f}, context-only acc {(ctx_only == y).float().mean():.3f}, "
          f"teacher top-1 prob {tl.softmax(-1).max(-1).values.mean():.3f}")
for name, (ce, l1, mk) in {"dspark 0.1CE+0.9L1": (0.1, 0.9, True), "dspark 1.0CE+0.9L1": (1.0, 0.9, True),
                           "dspark CE only": (1.0, 0.0, True), "no markov CE (dflash-like)": (1.0, 0.0, False),
                           }.items():
    print(f"{name:28s}", " | ".join(run(ce, l1, mk)), flush=True)
