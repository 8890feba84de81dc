import torch
from torch.profiler import profile, ProfilerActivity
from moe_dispatch.config import MoEConfig
from moe_dispatch.router import TopKRouter
cfg = MoEConfig(hidden_size=4096, num_experts=128, topk=6, ffn_hidden_size=1024, params_dtype=torch.bfloat16, aux_loss_coeff=1e-2)
r = TopKRouter(cfg, device='cuda', check_finite=False)
x = torch.randn(16384, 4096, device='cuda', dtype=torch.bfloat16, requires_grad=True)
for _ in range(5): r(x)
torch.cuda.synchronize()
import time
t = time.perf_counter()
for _ in range(20): r(x)
t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
print(f"host time per fwd (launch only): {(t1-t)/20*1e3:.3f} ms; with drain {(t2-t)/20*1e3:.3f} ms")
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
    for _ in range(5): r(x)
    torch.cuda.synchronize()
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=50))
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=50))
