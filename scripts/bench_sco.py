"""SCO benchmark on one H200 (24 layers, N = 65,536, H = 4096, bf16); see
peakflat_jax/bench/sco.py.

    PYTHONPATH=. python3 scripts/bench_sco.py --preset gpu [--only TEXT]
"""

import sys

from peakflat_jax.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "sco", *sys.argv[1:]]))
