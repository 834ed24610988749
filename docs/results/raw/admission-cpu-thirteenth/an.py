import json, collections, sys, statistics
L=[json.loads(l) for l in open(sys.argv[1])]
v=[x for x in L if x['ev']=='v']
r=[x for x in v if x['retry']]
print('retries',len(r),'known',sum(x['known'] for x in r), 'admitted', sum(x['reason'] is None for x in r))
c=collections.Counter((x['reason'], x['run'], x['wait']) for x in r)
for k,n in c.most_common(12): print(k,n)
late=[x['t']-x['due'] for x in r if x['due']]
print('late quantiles', [round(q,2) for q in statistics.quantiles(late,n=10)])
f=[x for x in v if not x['retry']]
print('fresh admitted', sum(x['reason'] is None for x in f), 'of', len(f))
print(collections.Counter((x['run'],x['wait']) for x in f if x['reason'] is None).most_common(8))
print(collections.Counter(x['msg'][:50] for x in r if x['reason']).most_common(5))
