"""Compares the cuDNN attention paths (one document, and packed documents through cuDNN's
segment layout) with the XLA kernel on random inputs: values and gradients, on this machine's
first device. Writes a JSON record. A GPU check: on a CPU only the XLA kernel exists.

    python scripts/check_attention.py [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from peakflat_jax.bench import harness
from peakflat_jax.model.attention import causal_attention


def relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    batch, length, heads, kv_heads, dim = 2, 1024, 8, 2, 128
    q, k, v = (jnp.asarray(rng.standard_normal((batch, length, h, dim)), jnp.bfloat16)
               for h in (heads, kv_heads, kv_heads))
    cotangent = jnp.asarray(rng.standard_normal((batch, length, heads, dim)), jnp.bfloat16)
    # Row 0: three documents and padding; row 1: one document.
    segments = np.ones((batch, length), np.int32)
    segments[0, 300:700], segments[0, 700:1000], segments[0, 1000:] = 2, 3, 0
    segment_ids = jnp.asarray(segments)
    cases = []
    for name, ids, max_segments in (("one document", None, 1),
                                    ("packed documents", segment_ids, 4)):
        def attend(q, k, v, implementation, ids=ids, max_segments=max_segments):
            out = causal_attention(q, k, v, ids, implementation=implementation,
                                   max_segments=max_segments)
            return jnp.sum(out.astype(jnp.float32) * cotangent.astype(jnp.float32))

        results = {}
        for implementation in ("xla", "cudnn"):
            q32, k32, v32 = (a.astype(jnp.float32) if implementation == "xla" else a
                             for a in (q, k, v))
            value, grads = jax.jit(jax.value_and_grad(attend, argnums=(0, 1, 2)),
                                   static_argnums=3)(q32, k32, v32, implementation)
            results[implementation] = (value, grads)
        (v_xla, g_xla), (v_cudnn, g_cudnn) = results["xla"], results["cudnn"]
        case = {"case": name, "value_rel": relative(v_cudnn, v_xla),
                **{f"d{n}_rel": relative(a, b) for n, a, b in zip("qkv", g_cudnn, g_xla)},
                "finite": bool(all(np.isfinite(np.asarray(g, np.float32)).all()
                                   for g in g_cudnn))}
        case["ok"] = case["finite"] and max(v for k_, v in case.items()
                                            if k_.endswith("_rel")) < 2e-2
        cases.append(case)
        print(json.dumps(case))
    path = harness.write_record(harness.new_record("attention_check", cases=cases),
                                args.out_dir)
    print(f"record: {path}")


if __name__ == "__main__":
    main()
