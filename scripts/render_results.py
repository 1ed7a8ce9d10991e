"""Prints the README's tables from the JSON records under scripts/results/.

    python scripts/render_results.py scripts/results/ring_dtp_gpu_*.json
"""

import importlib
import json
import sys

from peakflat_jax.cli import BENCHMARKS

for path in sys.argv[1:]:
    record = json.load(open(path))
    module = importlib.import_module(BENCHMARKS[record["benchmark"]])
    print(f"<!-- {path}: {record['command']} (commit {record['commit']}) -->")
    print(module.summarize(record), end="\n\n")
