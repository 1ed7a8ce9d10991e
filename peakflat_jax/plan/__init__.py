"""The planner: the per-device memory of a training step in closed form, before anything is
compiled; whether it fits; the largest context that does; and the launch knobs chosen for you.

Algorithm. A step's peak is not the sum of everything it ever allocates: it is the largest of
its live sets (SPEC.md, Composition). The planner lists every term of every live set as bytes
per device, each with a one-line formula, and composes them as the step runs:

    gradient program = persistent + boundaries + backward
                       + max(layer, boundaries.later + max(loss, embedding[, update]))
                       (boundaries.later: unrolled with a dense peak layer, the MoE stack's
                       boundaries, freed before the dense layers' backward; else 0)
    overlapped program = gradient program + staging + the MoE layers' per-layer weights
                         (scanned on a GPU: the MoE layers' new weights counted beside
                         max(the dense layer's forward, loss, embedding) only, with persistent +
                         boundaries + backward, or the gradient program, whichever is larger;
                         staging and XLA:GPU's packing beside either)
    optimizer program = grads + working params + staging  (OffloadStreamAdamW's own program)
    device total = max(the programs the trainer compiles)

(the overlapped program, with ``operators.optimizer_overlap``, applies the last step's update
inside the next step, its first step included; a flush runs the optimizer's own).

* persistent: the weight shards and their gradients, the device optimizer's fp32 master and
  moments (or nothing, when OffloadStreamAdamW keeps them in host memory, or the host CPU updates
  them: ``optimizer.update_on: host_cpu``), the router bias, the batch;
* boundaries: the checkpoint boundaries SCO keeps on the device, and every layer's integer
  carry leaves (``sco_memory_terms``);
* layer: one layer's recompute and backward, the largest layer kind: the restored boundaries,
  carry cotangents and parameter slices (``sco_memory_terms``), the layer's dense weights
  gathered whole with their whole gradient, its activations (attention's saved probabilities
  with the XLA kernel), and then in turn attention's backward or the FFN's, or the router's and
  the MoE's (``pipelined_moe_memory_terms``, or the worst-case buffers of unchunked dispatch);
* loss: Ring-DTP's strips (``ring_cross_entropy_memory_terms``) or the materialized logits
  (``materialized_memory_terms``), with the hidden state around them;
* backward: the embedding's dense gradient, which XLA may allocate early;
* embedding: the table gathered whole for the lookup;
* update: the fused on-device AdamW's fp32 temporaries (``on_device_adamw_memory_terms`` gives
  its state);
* overlap: the staging of the update inside the step, and the MoE layers' updated weights taken
  per layer beside their stacked copy (XLA:CPU's peak held both);
* host: OffloadStreamAdamW's state (``offload_stream_adamw_host_bytes``) or the host-CPU
  AdamW's state and transit (``host_cpu_adamw_host_terms``), the offloaded boundaries
  (``sco_host_bytes``) and the data pipeline (``pipeline_host_bytes``).

Each operator's terms come from the operator's own function: one source of truth per bound.
The weights' bytes come from the model itself (its abstract shapes under ``model.sharding``'s
placement), so a replicated leaf is counted whole. ``plan_terms`` gives every term;
``MEMORY_FORMULAS`` the formulas of the planner's own (the operators' are in their modules).

On a CPU the memory kinds lower to nothing: a plan for ``platform="cpu"`` keeps the
"offloaded" boundaries on the device, as XLA:CPU does.

Choosing the knobs (``choose_knobs``). A knob left null in a config (``operators.token_budget``,
``operators.vocab_block``, ``optimizer.resident_groups``) is filled by the rule ``--auto`` uses
for it: the fewest chunks, then the largest vocab block, that fit (memory falls and time rises
with chunks), and with the optimizer streamed the most groups whose state fits on the device
(``knobs.most_resident``); with the device's
memory unknown (a CPU), the tightest setting the config allows. ``--auto`` re-chooses all of
them with the offloaded boundaries, the optimizer's placement, its bucket size and slots, and
the mesh's data x seq split: it estimates each candidate's step time from measured rates
(``Rates``: FLOP rates, the host link, the all-to-all, the optimizer's streaming, the cost of a
chunk) and takes the fastest that fits; to maximise the context (or, at a given context, the
sequences per step) it first takes every knob at its lightest and searches, then the fastest
knobs there. Remat is fixed: every layer is rematerialized from its boundary (the only policy
the model has).

Why it is shaped so: the same terms serve three callers (``peakflat plan``, the trainer's check
before compiling, and the end-to-end benchmark that holds measured peaks against the plan), so
the composition lives in one function, ``plan_terms``, and everything else (feasibility, the
largest context, the search) calls it. The search is a few thousand closed-form evaluations,
no compile.

The package, one concept a module: ``terms`` (the knobs, the weights' bytes and every term:
the closed form), ``programs`` (composing them into each program's peak; a ``Plan``), ``knobs``
(nulls filled, or chosen: ``--auto``), ``rates`` (the step-time estimate), ``search``
(``make_plan``, the largest context, the mesh split), ``machine`` (this machine's memory, the
trainer's ``check_plan``), ``report`` (JSON and the table), ``cli`` (``peakflat plan``) and
``check`` (``--check``: the closed form held to XLA's plan of the compiled programs). The names
below are importable from ``peakflat_jax.plan`` itself, lazily: ``peakflat`` adds its
arguments before jax may be imported.

Measured: docs/plan.md.

Legend: W devices (data x seq), B sequences per step, T context, N = B T / W tokens per device,
H hidden, L layers (L_d dense, L_m MoE), V vocab, V' = V padded to a multiple of W, Vs = V' / W,
Hq / Hkv query / kv heads (Hkv' = Hq where seq does not divide Hkv: the kv heads are repeated),
D head width, E experts, k top-k, F expert FFN, F_d dense FFN, F_s shared expert FFN, P
parameters on a device (its shards), D_l one layer's dense weights (whole), C = N H b one
boundary, b bytes of the model's dtype.
"""


from __future__ import annotations

import importlib

_MODULES = ("errors", "terms", "programs", "rates", "knobs", "search", "machine", "report")


def __getattr__(name: str):
    """A name of one of the planner's modules (``_MODULES``), imported when first asked for."""
    for module in _MODULES:
        imported = importlib.import_module(f"{__name__}.{module}")
        if hasattr(imported, name):
            return getattr(imported, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
