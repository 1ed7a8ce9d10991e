"""``python -m peakflat_jax.cli``: the ``peakflat`` command."""

import sys

from peakflat_jax.cli import main

sys.exit(main())
