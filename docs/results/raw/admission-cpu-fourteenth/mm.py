import torch, time
torch.set_num_threads(1)
def t(f, n=2000):
    for _ in range(50): f()
    t0=time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter()-t0)/n*1e6
x=torch.randn(1,320)
for (i,o) in ((320,1792),(896,320),(320,448)):
    W=torch.randn(o,i)            # row-major [out,in]
    Wt=W.t().contiguous().t()     # transposed view of [in,out]
    Wb=W.bfloat16(); xb=x.bfloat16()
    xi=torch.randn(1,i)
    print((i,o), 'row-major %.1f us'%t(lambda: torch.nn.functional.linear(xi,W)),
          'tview %.1f us'%t(lambda: torch.nn.functional.linear(xi,Wt)),
          'bf16 %.1f us'%t(lambda: torch.nn.functional.linear(xi.bfloat16(),Wb)),
          'mv %.1f us'%t(lambda: torch.mv(W, xi[0])),
          'MB %.2f'%(W.numel()*4/1e6))
# stacked: 12 layers worth of distinct weights (cache effects)
Ws=[torch.randn(1792,320).t().contiguous().t() for _ in range(12)]
xi=torch.randn(1,320)
print('12 distinct gate_up tview %.1f us each'%(t(lambda: [torch.nn.functional.linear(xi,w) for w in Ws],200)/12))
Ws=[torch.randn(1792,320) for _ in range(12)]
print('12 distinct gate_up rowmajor %.1f us each'%(t(lambda: [torch.nn.functional.linear(xi,w) for w in Ws],200)/12))
a=torch.randn(16_000_000); b=torch.empty_like(a)
print('copy 64MB GB/s %.1f'%(128/ (t(lambda: b.copy_(a),20)/1e6)/1e3))
