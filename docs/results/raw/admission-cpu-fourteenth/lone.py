import statistics, time, sys, os
import torch
from adaserve.kv.cache import KVCache
from adaserve.models.attention import AttnMetadata, SeqSpec
from adaserve.models.loader import load_model
from adaserve.util import paths
torch.set_num_threads(1)
DT = getattr(torch, os.environ.get("DT", "float32"))
model = load_model(paths.DEFAULT_TARGET, torch.device("cpu"), DT, False)
kv = KVCache(model.cfg, 4000, torch.device("cpu"), DT)
def seqs(q, c=300):
    return [SeqSpec(list(range(0, c)), list(range(c, c+q)), list(range(c, c+q)))]
def run(q, reps=50, fn=None):
    s = seqs(q); ids = torch.randint(0, model.cfg.vocab_size, (q,))
    ts=[]
    for _ in range(reps):
        with torch.inference_mode():
            t0=time.perf_counter()
            meta = AttnMetadata.build(s, torch.device("cpu"), None)
            t1=time.perf_counter()
            h = (fn or model)(ids, meta, kv.layers)
            model.logits(h[-1:]).argmax(-1).tolist()
            ts.append(((time.perf_counter()-t0)*1000, (t1-t0)*1000))
    return statistics.median(x for x,_ in ts[5:]), statistics.median(y for _,y in ts[5:])
for q in (1,4,8):
    print("q",q,"total/meta ms", run(q))
if len(sys.argv)>1 and sys.argv[1]=="prof":
    from torch.profiler import profile, ProfilerActivity
    s=seqs(1); ids=torch.randint(0,4096,(1,))
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(20):
            meta = AttnMetadata.build(s, torch.device("cpu"), None)
            h = model(ids, meta, kv.layers)
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
