#!/usr/bin/env bash
# MaxText 0.2.5 for the end-to-end bench's peer, on a GPU machine without network: installs the
# carried wheels (WHEELS below, fetched beforehand by `setup.sh download DIR` where pip has a
# network) into a target folder with --no-deps: MaxText's own cuda12 extra pins ~300 packages,
# jax for CUDA 12 and TransformerEngine among them, against the image's CUDA 13 jax. What a
# synthetic-data run imports is these 20 packages over the image's jax, flax, optax, orbax and
# numpy; tokamax imports xprof for its benchmarks only, for which a 4-file stub stands in.
#
#   bash scripts/maxtext/setup.sh download .whl        # here, once (pip with a network)
#   bash scripts/maxtext/setup.sh install .whl SITE    # there; then PYTHONPATH=SITE
set -euo pipefail
WHEELS=(maxtext==0.2.5 pathwaysutils==0.1.13 fastapi==0.141.1 starlette==1.10.0 uvicorn==0.55.0
        pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
        omegaconf==2.4.0 aqtp==0.9.0 qwix==0.1.8 tokamax==0.0.17 immutabledict==4.3.1
        einshape==1.0 grain==0.2.18 portpicker==1.6.0 array-record==0.8.6 drjax==0.2.1
        ml-collections==1.1.0)
# Installed only where the image's copy is missing or older than MaxText wants.
OPTIONAL=(orbax-checkpoint==0.12.8 typing-extensions==4.16.0)
case "${1:-}" in
  download)
    dir=${2:?folder}; mkdir -p "$dir/opt"
    platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64
               --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    for wheel in "${WHEELS[@]}"; do
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d "$dir" "$wheel"; done
    for wheel in "${OPTIONAL[@]}"; do
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d "$dir/opt" "$wheel"; done ;;
  install)
    dir=${2:?folder} site=${3:?target}
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "$dir"/*.whl
    python3 - "$dir/opt" "$site" <<'PY'
import glob, subprocess, sys
from importlib import metadata

floors = {"orbax_checkpoint": ("orbax-checkpoint", (0, 12, 4)),
          "typing_extensions": ("typing_extensions", (4, 14, 1))}
for prefix, (dist, floor) in floors.items():
    try:
        have = tuple(int(x) for x in metadata.version(dist).split(".")[:3] if x.isdigit())
    except metadata.PackageNotFoundError:
        have = None
    if have is None or have < floor:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-compile", "--upgrade", "--target", sys.argv[2],
                        *glob.glob(f"{sys.argv[1]}/{prefix}-*.whl")], check=True)
        print(f"{dist}: {have} < {floor}, installed the carried wheel")
PY
    if ! PYTHONPATH=$site python3 -c "import xprof.cli.tools.get_kernel_stats_tool" 2>/dev/null; then
      mkdir -p "$site/xprof/cli/tools"
      echo '"""Stub: tokamax imports this for its benchmarks only."""' >"$site/xprof/__init__.py"
      : >"$site/xprof/cli/__init__.py"; : >"$site/xprof/cli/tools/__init__.py"
      printf 'def compute_kernel_stats(*a, **k):\n    raise NotImplementedError("xprof stub")\n' \
        >"$site/xprof/cli/tools/get_kernel_stats_tool.py"
    fi
    PYTHONPATH=$site python3 -c "import maxtext, tokamax; print('maxtext', maxtext.__file__)" ;;
  *) echo "usage: setup.sh download DIR | install DIR SITE" >&2; exit 2 ;;
esac
