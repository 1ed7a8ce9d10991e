"""PipelinedLLEP benchmark (two H200s at the paper's shapes); see
peakflat_jax/bench/moe_dispatch.py. Needs the Mosaic GPU grouped matmul to be useful.

    PYTHONPATH=. python3 scripts/bench_moe_dispatch.py --preset gpu [--only TEXT]
"""

import sys

from peakflat_jax.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "moe_dispatch", *sys.argv[1:]]))
