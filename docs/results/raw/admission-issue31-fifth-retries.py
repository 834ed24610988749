import sys, json, subprocess, tempfile
from pathlib import Path
sys.path.insert(0, 'benchmarks')
import admission_sim as a
from concurrent.futures import ThreadPoolExecutor
def one(j):
    rate, seed = j
    with tempfile.TemporaryDirectory() as out:
        cmd=[sys.executable,'-m','adaserve','simulate',*a.REF,'--request-rate',str(rate),'--duration','180','--seeds',str(seed),'--policies','adaserve','--no-plots','--no-progress','--out',out,'--admission','--retry-refused']
        subprocess.run(cmd, check=True, capture_output=True)
        res=json.loads((Path(out)/'result.json').read_text())['results']['adaserve']
        s=json.dumps(res)
        o=res['overall']
        rt=o.get('retries') or {}
        pc={k:v.get('admitted_attainment', v) for k,v in res['per_class'].items()}
        summ=a.summarize([dict(res, _records={})])
        return rate, seed, rt, summ['admitted_pct']
jobs=[(float(x.split(':')[0]),int(x.split(':')[1])) for x in sys.argv[1].split(',')]
with ThreadPoolExecutor(2) as ex:
    for r in ex.map(one, jobs): print(sys.argv[2], *r, flush=True)
