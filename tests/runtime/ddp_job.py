"""One rank of the DDP test (tests/runtime/test_distributed.py): eager DDP, then the same
training under the runtime, on the same data; prints what it found as JSON."""
import copy, json, sys, torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
rank = int(sys.argv[1]); world = 2
dist.init_process_group("gloo", init_method=f"file://{sys.argv[2]}", rank=rank, world_size=world)
import adaptive_eager as ae
from adaptive_eager.runtime.compiler import use_compiler
from adaptive_eager.testing import CountingCompiler
torch.manual_seed(0)
base = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                           torch.nn.Linear(64, 8))
def train(model, steps):
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, foreach=True)
    torch.manual_seed(100 + rank)
    for _ in range(steps):
        data, target = torch.randn(16, 32), torch.randn(16, 8)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(data), target)
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]
eager = train(copy.deepcopy(base), 6)
with use_compiler(CountingCompiler()), ae.enabled():
    adaptive = train(copy.deepcopy(base), 6)
    ae.sync()
s = ae.stats()
same = all(torch.allclose(a, e, rtol=1e-5, atol=1e-6) for a, e in zip(adaptive, eager))
print(json.dumps({"rank": rank, "same": same, "fused": s.fused_executions, "compiles": s.compiles,
                  "disk": s.cache_hits_disk, "collective": s.fallbacks.get("collective", 0)}))
dist.destroy_process_group()
