"""OffloadStreamAdamW benchmark on one H200 (2e9 params); see peakflat_jax/bench/offload_adamw.py.

    PYTHONPATH=. python3 scripts/bench_offload_adamw.py --preset gpu [--only TEXT]
"""

import sys

from peakflat_jax.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "offload_adamw", *sys.argv[1:]]))
