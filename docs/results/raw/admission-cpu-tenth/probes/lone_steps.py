"""Lone interactive requests in-process; per step: shapes, draft passes, all draft f,
selected nodes, accepted, ms. Output JSON lines."""
import json, sys, time
import numpy as np
from adaserve import LLM, SamplingParams
import adaserve.engine.executor as ex

pol = sys.argv[1] if len(sys.argv) > 1 else "adaserve"
N = int(sys.argv[2]) if len(sys.argv) > 2 else 60
out = open(sys.argv[3] if len(sys.argv) > 3 else f"/tmp/probe/steps-{pol}.jsonl", "w")
import os
llm = LLM(policy=pol, dtype=os.environ.get("DT", "auto"))
e = llm.engine
orig_exec = ex.EngineExecutor.execute
orig_spec = ex.EngineExecutor._speculate
cur = {}
def spec(self, batch):
    d = orig_spec(self, batch)
    cur["drafts"] = {rid: (o.tree.f.tolist(), o.tree.depth.tolist(), o.tree.parents.tolist()) for rid, o in d.items()}
    cur["shapes"] = [shape for _, shape in batch.spec]
    return d
def execute(self, out_):
    cur.clear()
    so = orig_exec(self, out_)
    rec = {"ms": so.ms, "pred": so.predicted_ms, "tokens": so.tokens,
           "shapes": cur.get("shapes"), "draft": [so.draft.catchup, list(so.draft.steps)],
           "nodes": so.tree_nodes, "acc": so.accepted, "exp": so.expected,
           "drafts": cur.get("drafts"), "rid": self.engine.current_rid if hasattr(self.engine,'current_rid') else None}
    out.write(json.dumps(rec) + "\n")
    return so
ex.EngineExecutor._speculate = spec
ex.EngineExecutor.execute = execute
sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
for i in range(N):
    prompt = " ".join(f"w{(i * 7 + k) % 97}" for k in range(8))
    t0 = time.perf_counter()
    o = llm.generate([prompt], sp, slo="interactive", use_tqdm=False)
    dt = time.perf_counter() - t0
    out.write(json.dumps({"req": i, "wall": dt, "ntok": len(o[0].outputs[0].token_ids)}) + "\n")
out.close()
