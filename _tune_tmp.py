import torch, triton, itertools
from moe_dispatch.router._triton_gemm import triton_row_stable_mm
from moe_dispatch.config import MoEConfig
from moe_dispatch.router import TopKRouter
def bench(fn): return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
shapes = [(16384, 4096, 128), (16384, 7168, 256)]
fp32_cfgs = [(64,64,32,4,3),(128,64,32,8,3),(128,128,16,8,2),(64,128,32,4,3),(128,128,32,8,3),(32,128,32,4,3),(64,64,16,4,4),(128,64,16,4,3),(64,32,32,4,3),(32,64,32,4,3),(128,32,32,4,3),(64,128,16,8,3),(256,64,16,8,2)]
bf16_cfgs = [(64,128,64,4,4),(128,128,64,8,3),(64,64,64,4,4),(128,64,64,4,4),(64,256,64,8,3),(128,256,64,8,3)]
for (T,H,E) in shapes:
    x = torch.randn(T,H,device='cuda',dtype=torch.bfloat16)
    for wdt, cfgs, opname in ((torch.float32, fp32_cfgs, 'fp32 FMA'), (torch.bfloat16, bf16_cfgs, 'bf16 MMA')):
        w = (torch.randn(E,H,device='cuda')*0.02).to(wdt)
        ref = x.double() @ w.double().t()
        for c in cfgs:
            try:
                full = triton_row_stable_mm(x, w, torch.float32, _config=c)
                stable = all(torch.equal(triton_row_stable_mm(x[:n], w, torch.float32, _config=c), full[:n]) for n in (1,7,65,1000))
                ms = bench(lambda: triton_row_stable_mm(x, w, torch.float32, _config=c))
                print(f"{T},{H},{E} {opname} cfg={c} {ms:.3f} ms stable={stable} err={(full.double()-ref).abs().max().item():.1e}")
            except Exception as e:
                print(f"{T},{H},{E} {opname} cfg={c} FAILED {type(e).__name__}: {str(e)[:100]}")
        cub = bench(lambda: x.float() @ w.float().t())
        print(f"{T},{H},{E} cuBLAS fp32 {cub:.3f} ms")
