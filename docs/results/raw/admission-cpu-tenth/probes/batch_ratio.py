import json, sys, time, threading, statistics as S
from adaserve import LLM, SamplingParams
import adaserve.engine.executor as ex
busy = sys.argv[1] if len(sys.argv) > 1 else "none"
if len(sys.argv) > 2: sys.setswitchinterval(float(sys.argv[2]))
llm = LLM(policy="adaserve")
orig = ex.EngineExecutor.execute
rec = []
def execute(self, out_):
    so = orig(self, out_)
    rec.append((len(out_.batch.decode), len(out_.batch.prefill), so.ms, so.predicted_ms))
    return so
ex.EngineExecutor.execute = execute
stop = False
def spin():  # pure-python work in bursts: ~7-20% duty
    while not stop:
        t = time.perf_counter()
        while time.perf_counter() - t < 0.0005:
            sum(range(50))
        time.sleep(0.003)
if busy == "py":
    threading.Thread(target=spin, daemon=True).start()
sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
llm.generate(["w1 w2 w3"], sp, use_tqdm=False)
rec.clear()
for n in (1, 2, 4):
    for i in range(12):
        prompts = [" ".join(f"w{(i * 7 + k + 13*j) % 97}" for k in range(8)) for j in range(n)]
        llm.generate(prompts, sp, slo="interactive", use_tqdm=False)
stop = True
by = {}
for d, p, ms, pr in rec:
    if p == 0 and pr: by.setdefault(d, []).append(ms / pr)
print(busy, sys.getswitchinterval(), {d: (len(v), round(S.median(v), 3), round(S.quantiles(v, n=10)[-1], 3)) for d, v in sorted(by.items())})
