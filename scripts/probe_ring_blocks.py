"""Probe (GPU): the cost of the vocab_block loop against the whole shard and the baseline.

Recorded in scripts/results/ring_dtp_block_probe_20261130.json; it found that XLA merged
backward's strip matmul with forward's (now prevented by an optimization barrier).
"""
import json, time, math, sys
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P
from peakflat_jax.ops import ring_cross_entropy as rce
from peakflat_jax import reference

def timeit(f, *a, n=5):
    for _ in range(2): jax.block_until_ready(f(*a))
    ts=[]
    for _ in range(n):
        t=time.perf_counter(); jax.block_until_ready(f(*a)); ts.append(time.perf_counter()-t)
    return sorted(ts)[len(ts)//2]

N,H,V = 8192, 7168, 200000
k = jax.random.split(jax.random.key(0), 3)
x = jax.random.normal(k[0], (N,H)); w = jax.random.normal(k[1], (H,V))/math.sqrt(H); t = jax.random.randint(k[2], (N,), 0, V)
mesh = Mesh(np.array(jax.devices()[:1]), ("vocab",))
def sm(fn): return jax.shard_map(fn, mesh=mesh, in_specs=(P("vocab"),P(None,"vocab"),P("vocab")), out_specs=P("vocab"))
res = {}
a = jax.random.normal(k[0], (8192,7168)); b = jax.random.normal(k[1], (7168,8192))
for prec in (None, "highest"):
    f = jax.jit(lambda a,b: jnp.dot(a,b,precision=prec))
    s = timeit(f,a,b,n=10); res[f"gemm8192 {prec}"] = 2*8192*7168*8192/s/1e12
f = jax.jit(lambda a,w: jnp.dot(a,w)); s=timeit(f,a,w); res["gemm 8192x7168x200000"] = 2*8192*7168*V/s/1e12
cases = {"materialized": lambda x,w,t: reference.materialized_cross_entropy(x,w,t,axis_name="vocab")}
for B in (None, 8192, 25000, 50000):
    cases[f"ring B={B}"] = (lambda B: lambda x,w,t: rce.ring_cross_entropy(x,w,t,axis_name="vocab",vocab_block=B))(B)
for name, fn in cases.items():
    lf = sm(fn)
    fb = jax.jit(jax.value_and_grad(lambda x,w: lf(x,w,t).mean(), argnums=(0,1)))
    fo = jax.jit(lambda x,w: lf(x,w,t).mean())
    res[name+" fwd+bwd ms"] = 1e3*timeit(fb,x,w); res[name+" fwd ms"] = 1e3*timeit(fo,x,w)
    print(name, res[name+" fwd+bwd ms"], res[name+" fwd ms"], flush=True)
# the same block loop unrolled in Python
orig = rce._fold_blocks
def unrolled(ring, per_block, init):
    acc = init
    for b in range(ring.num_blocks): acc = per_block(b, acc)
    return acc
rce._fold_blocks = unrolled
lf = sm(lambda x,w,t: rce.ring_cross_entropy(x,w,t,axis_name="vocab",vocab_block=25000))
res["ring B=25000 unrolled fwd+bwd ms"] = 1e3*timeit(jax.jit(jax.value_and_grad(lambda x,w: lf(x,w,t).mean(), argnums=(0,1))),x,w)
res["ring B=25000 unrolled fwd ms"] = 1e3*timeit(jax.jit(lambda x,w: lf(x,w,t).mean()),x,w)
print(json.dumps(res, indent=1))
