import sys, json, os
sys.path.insert(0, 'benchmarks')
import admission_sim as a
from concurrent.futures import ThreadPoolExecutor
jobs=[(float(x.split(':')[0]),int(x.split(':')[1])) for x in sys.argv[1].split(',')]
tag=sys.argv[2]
off=json.load(open('/tmp/h31/off_cache.json'))
with ThreadPoolExecutor(2) as ex:
    on=list(ex.map(lambda j: a.run_one(j[0],j[1],True,180.0,'adaserve'), jobs))
rates=sorted(set(r for r,_ in jobs))
for r in rates:
    ons=[o for (rr,s),o in zip(jobs,on) if rr==r]; seeds=[s for rr,s in jobs if rr==r]; offs=[off[f'{r}:{s}'] for s in seeds]
    for s,o,f in zip(seeds,ons,offs):
        so,sf=a.summarize([o]),a.summarize([f])
        print(f"{tag} r={r} seed={s} refused={so['refused_pct']:.1f} gap={sf['attain_all_pct']-so['attain_all_pct']:.2f} strict={so['admitted_pct'].get('interactive',0):.1f} adm_all={so['admitted_all_pct']:.1f} gp={so['goodput']/max(sf['goodput'],1e-9):.2f}x reasons={so['reasons']}",flush=True)
    so,sf=a.summarize(ons),a.summarize(offs)
    print(f"{tag} r={r} ALL refused={so['refused_pct']:.2f} gap={sf['attain_all_pct']-so['attain_all_pct']:.2f} strict={so['admitted_pct'].get('interactive',0):.2f} adm_all={so['admitted_all_pct']:.2f} gp={so['goodput']/max(sf['goodput'],1e-9):.2f}x reasons={so['reasons']}")
