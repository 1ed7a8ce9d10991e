"""Ring-DTP benchmark at the paper's shapes (H = 7168, V = 200,000, fp32); see
peakflat_jax/bench/ring_dtp.py. Run on the GPU machines from the repository root:

    PYTHONPATH=. python3 scripts/bench_ring_dtp.py --preset gpu [--only TEXT] [--out-dir DIR]

It is `peakflat bench ring_dtp` under another name; records go to scripts/results/.
"""

import sys

from peakflat_jax.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "ring_dtp", *sys.argv[1:]]))
