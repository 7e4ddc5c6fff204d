"""dflash_train.bench with this session's experimental patches, chosen by environment variables
(experiments only: none of them is in the trainer; see README.md for what each measured):
  FLEX_OPTS   a dict literal of flex-attention kernel_options
  FUSE_MLP=1  the target's gate/up projections as one matmul (views keep the two weights)
  TARGET_MODE a torch.compile mode for the target layers
  NOSYNC=1    the fused optimizer step without waiting for the gradient norm (timing probe only:
              the norm it reports is a placeholder)
It also prints how many steps had a non-finite loss or gradient norm.

    FLEX_OPTS="{'ROWS_GUARANTEED_SAFE': True}" python benchmarks/h100-2026-11-25c/variants.py <bench arguments>
"""
import ast, os, sys, types
import torch
import torch.nn.functional as F
import torch.nn.attention.flex_attention as fa
from dflash_train.model import target as tg
from dflash_train import bench

opts = ast.literal_eval(os.environ.get("FLEX_OPTS", "{}"))
if opts:
    orig = fa.flex_attention
    def patched(*a, **kw):
        kw.setdefault("kernel_options", dict(opts))
        return orig(*a, **kw)
    fa.flex_attention = patched

def _fused_mlp_forward(self, x):
    gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)

def fuse(model):
    n = 0
    for layer in tg.decoder_layers(model):
        mlp = layer.mlp
        g, u = mlp.gate_proj, mlp.up_proj
        w = torch.cat([g.weight.data, u.weight.data])
        i = g.weight.shape[0]
        g.weight.data, u.weight.data = w[:i], w[i:]
        mlp.register_buffer("gate_up_weight", w, persistent=False)
        mlp.forward = types.MethodType(_fused_mlp_forward, mlp)
        n += 1
    print(f"fused gate/up in {n} layers", flush=True)

orig_compile = tg.TargetModel.compile_layers
def compile_layers(self):
    if os.environ.get("FUSE_MLP"):
        fuse(self.model)
    mode = os.environ.get("TARGET_MODE")
    if mode:
        for layer in tg.decoder_layers(self.model):
            layer.forward = torch.compile(layer.forward, mode=mode)
        return
    orig_compile(self)
tg.TargetModel.compile_layers = compile_layers

from dflash_train.training import trainer as tr
_ts = tr.Trainer.train_step
bad = []
def train_step(self, step):
    out = _ts(self, step)
    if not out["finite"]:
        bad.append(step)
    return out
tr.Trainer.train_step = train_step

if os.environ.get("NOSYNC"):
    from dflash_train.distributed import torch_native as tn
    def fused_nosync(self, loss):
        total = torch.nn.utils.get_total_norm([p.grad for p in self._params if p.grad is not None]).float()
        ok = torch.isfinite(total) if loss is None else torch.isfinite(total) & torch.isfinite(loss)
        self.optimizer.grad_scale = (total / self.clip_grad_norm).clamp(min=1.0)
        self.optimizer.found_inf = (~ok).float()
        self.optimizer.step()
        return self._after_update(1.0)
    tn._TorchBackend._fused_step = fused_nosync
try:
    bench.main(sys.argv[1:])
finally:
    print(f"non-finite steps: {len(bad)} {bad[:20]}", flush=True)
