"""Lone interactive requests in-process on core 1, with core 0 idle, busy in pure Python,
or busy copying memory: each pass's wall and thread CPU time over its prediction.
Usage (alone on the machine): taskset -c 1 .venv/bin/python neighbour.py ROUNDS N"""
import json
import subprocess
import sys
import time

import numpy as np

import adaserve.engine.executor as ex
from adaserve import LLM, SamplingParams

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
N = int(sys.argv[2]) if len(sys.argv) > 2 else 10
NEIGHBOURS = {
    "idle": None,
    "python": "while True: pass",
    "memory": "import numpy as np\na = np.ones(1 << 25)\nwhile True: b = a.copy()",
    "http-ish": "import json, time\nwhile True:\n    t = time.perf_counter()\n    while time.perf_counter() - t < 0.004: json.dumps({'x': list(range(50))})\n    time.sleep(0.004)",
}
llm = LLM(policy="adaserve")
rows = []
orig = ex.EngineExecutor.execute


def execute(self, out_):
    c0 = time.thread_time()
    so = orig(self, out_)
    rows.append((so.ms, (time.thread_time() - c0) * 1000, so.predicted_ms))
    return so


ex.EngineExecutor.execute = execute
sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
llm.generate(["w1 w2 w3"], sp, slo="interactive", use_tqdm=False)
res = {k: [] for k in NEIGHBOURS}
for r in range(rounds):
    for name, code in NEIGHBOURS.items():
        p = None
        if code:
            p = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c", code])
            time.sleep(0.5)
        rows.clear()
        for i in range(N):
            prompt = " ".join(f"w{(i * 7 + k) % 97}" for k in range(8))
            llm.generate([prompt], sp, slo="interactive", use_tqdm=False)
        if p:
            p.kill()
            p.wait()
        a = np.array([x for x in rows if x[2]])
        res[name].append((np.median(a[:, 0] / a[:, 2]), np.median(a[:, 1] / a[:, 2]), len(a)))
for k, v in res.items():
    v = np.array(v)
    print(f"{k:9s} wall/pred p50 by round {np.round(v[:, 0], 2)}  cpu/pred {np.round(v[:, 1], 2)}")
print(json.dumps({k: [list(map(float, x)) for x in v] for k, v in res.items()}))
