"""Identical Mosaic GPU kernels share one compiled kernel (a fix for jax 0.11.2's hashing).

jaxlib compiles each Mosaic GPU custom call once per distinct ``kernel_hash`` (a process-wide
cache), and that hash is the sha256 of the kernel module's bytecode. In jax 0.11.2 Pallas'
Mosaic lowering first stamps the module with ``mosaic_gpu.dump_basename``, a name that carries a
process-global counter (``get_or_set_dump_options``, for debug dumps), so every call site hashes
differently: a program with N calls of one kernel compiles it N times, and the persistent
cache's key depends on how many kernels the process lowered before. Removing the attribute
before the hash is taken makes identical kernels hash alike; the attribute only names dump
files, and jaxlib stamps it again when it compiles a module that lacks it.

``share_identical_kernels()`` wraps the lowering rule once per process (idempotent). The
wrapper changes nothing else: kernels that differ in any op, shape or block still differ.
"""

from __future__ import annotations

import functools

_DUMP_ATTRIBUTE = "mosaic_gpu.dump_basename"
_installed = False


def share_identical_kernels() -> None:
    """Make ``jax.experimental.mosaic.gpu.core``'s lowering hash a kernel without its per-call
    dump name (module doc). Safe to call more than once; a no-op where Mosaic GPU is absent."""
    global _installed
    if _installed:
        return
    try:
        from jax._src.interpreters import mlir
        from jax.experimental.mosaic.gpu import core
    except ImportError:  # no Mosaic GPU in this jaxlib: nothing to fix
        return
    original = core._mosaic_gpu_lowering_rule

    @functools.wraps(original)
    def lowering_rule(ctx, *args, module, **kwargs):
        attributes = module.operation.attributes
        if _DUMP_ATTRIBUTE in attributes:
            del attributes[_DUMP_ATTRIBUTE]
        return original(ctx, *args, module=module, **kwargs)

    # Pallas calls the rule through the module attribute; the primitive's registration for
    # "cuda" holds the original function object, so both are replaced.
    core._mosaic_gpu_lowering_rule = lowering_rule
    mlir.register_lowering(core.mosaic_gpu_p, lowering_rule, "cuda")
    _installed = True
