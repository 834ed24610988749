import sys, json, os
sys.path.insert(0, 'benchmarks')
import admission_sim as a
from concurrent.futures import ThreadPoolExecutor
rates=[float(x) for x in sys.argv[1].split(',')]; seeds=a._seeds(sys.argv[2]); tag=sys.argv[3]
os.makedirs('/tmp/h31', exist_ok=True)
cache='/tmp/h31/off_cache.json'
off=json.load(open(cache)) if os.path.exists(cache) else {}
jobs=[(r,s) for r in rates for s in seeds]
need=[(r,s) for r,s in jobs if f'{r}:{s}' not in off]
with ThreadPoolExecutor(2) as ex:
    on=list(ex.map(lambda j: a.run_one(j[0],j[1],True,180.0,'adaserve'), jobs))
    offr=list(ex.map(lambda j: a.run_one(j[0],j[1],False,180.0,'adaserve'), need))
for (r,s),o in zip(need,offr):
    o['_records']={str(k):v for k,v in o['_records'].items()}
    off[f'{r}:{s}']=o
json.dump(off,open(cache,'w'))
for r in rates:
    ons=[o for (rr,s),o in zip(jobs,on) if rr==r]; offs=[off[f'{r}:{s}'] for s in seeds]
    for s,o,f in zip(seeds,ons,offs):
        so,sf=a.summarize([o]),a.summarize([f])
        print(f"{tag} r={r} seed={s} refused={so['refused_pct']:.1f} all_on={so['attain_all_pct']:.1f} all_off={sf['attain_all_pct']:.1f} strict={so['admitted_pct'].get('interactive',0):.1f} adm_all={so['admitted_all_pct']:.1f} gp={so['goodput']/max(sf['goodput'],1e-9):.2f}x reasons={so['reasons']}")
    so,sf=a.summarize(ons),a.summarize(offs)
    print(f"{tag} r={r} ALL refused={so['refused_pct']:.2f} all_on={so['attain_all_pct']:.2f} all_off={sf['attain_all_pct']:.2f} strict={so['admitted_pct'].get('interactive',0):.2f} adm_all={so['admitted_all_pct']:.2f} gp={so['goodput']/max(sf['goodput'],1e-9):.2f}x reasons={so['reasons']}")
