"""The plan as JSON (API.md's object) and as the table ``peakflat plan`` prints."""

from __future__ import annotations

from peakflat_jax.plan.errors import GIB
from peakflat_jax.plan.programs import Plan
from peakflat_jax.plan.rates import attention_fraction
from peakflat_jax.plan.terms import LIVE_SETS, PHASES


def plan_json(plan: Plan) -> dict:
    """API.md's object: terms, total_bytes, device_bytes, feasible, baseline; plus the
    programs, phases, host terms, the knobs (with the rules that chose them) and the largest
    context that fits."""
    def one(p: Plan) -> dict:
        return {"terms": p.device_terms(), "total_bytes": p.total_bytes,
                "feasible": p.feasible, "programs": p.programs, "phases": p.phases,
                "peak_phase": p.peak_phase, "host_terms": p.host_terms(),
                "host_bytes": p.host_bytes, "reasons": p.reasons(),
                "largest_context": p.largest_context}

    out = one(plan)
    out.update({
        "device_bytes": plan.device_memory, "host_memory_bytes": plan.host_memory,
        "config": plan.config.name, "platform": plan.platform,
        "devices": plan.knobs.num_devices, "tokens_per_device": plan.knobs.tokens_per_device,
        "knobs": plan.knobs.as_config(),
        "choices": [{"key": c.key, "value": c.value, "why": c.why} for c in plan.choices],
        "step_seconds_estimate": plan.step_seconds,
        "step_attention_fraction": attention_fraction(plan.config, plan.knobs.context),
        "formulas": {t.name: t.formula for t in plan.terms},
    })
    if plan.baseline is not None:
        out["baseline"] = one(plan.baseline)
    return out


def format_table(plan) -> str:
    """The terms of a ``peakflat_jax.plan.Plan`` (operators on, baseline), the programs'
    totals, feasibility and why, the knobs chosen and the largest context; in GiB, or MiB for a
    plan under 1 GiB."""

    unit, scale = ("GiB", GIB) if plan.total_bytes >= GIB else ("MiB", 2**20)

    def _gib(value: int | None) -> str:
        return "" if value is None else f"{value / scale:,.3f}"

    knobs = plan.knobs
    base = plan.baseline
    lines = [
        f"peakflat plan {plan.config.name}: {knobs.num_devices} {plan.platform} devices (data "
        f"{knobs.data} x seq {knobs.seq}), context {knobs.context:,} x batch "
        f"{knobs.batch_size} = N {knobs.tokens_per_device:,} tokens per device",
        f"memory per device: device {_gib(plan.device_memory) or 'unknown'} {unit}, host "
        f"{_gib(plan.host_memory) or 'unknown'} {unit}; attention {knobs.attention}",
        "",
    ]
    names = [t.name for t in plan.terms]
    if base is not None:
        names += [t.name for t in base.terms if t.name not in names]
    on = {t.name: t for t in plan.terms}
    off = {t.name: t for t in base.terms} if base is not None else {}
    header = f"{'term':34} {'live':16} {'on ' + unit:>12} {'baseline ' + unit:>13}  formula"
    lines += [header, "-" * len(header)]
    order = {live: i for i, live in enumerate(LIVE_SETS)}
    names.sort(key=lambda name: order[(on.get(name) or off.get(name)).live])
    for name in names:
        term = on.get(name) or off.get(name)
        lines.append(f"{name:34} {term.live:16} {_gib(on[name].bytes) if name in on else '-':>12}"
                     f" {_gib(off[name].bytes) if name in off else '-':>13}  {term.formula}")
    lines.append("")
    lines.append("peak = persistent + boundaries + backward + the largest phase (phases never "
                 "overlap; boundaries.later beside every phase but the layer's); the offloaded "
                 "optimizer's step is its own program")
    for label, p in ((_label(plan), plan), ("baseline", base)):
        if p is None:
            continue
        phases = ", ".join(f"{phase} {_gib(p.phases[phase])}" for phase in PHASES
                           if p.phases[phase])
        programs = ", ".join(f"{name} {_gib(value)}" for name, value in p.programs.items())
        verdict = {True: "fits", False: "does NOT fit", None: "unknown (device memory)"}[
            p.feasible]
        lines.append(f"{label:13} total {_gib(p.total_bytes)} {unit} (programs: {programs}; "
                     f"phases: {phases}; peak phase {p.peak_phase}); host "
                     f"{_gib(p.host_bytes)} {unit}: {verdict}")
        for reason in p.reasons():
            lines.append(f"{'':13} {reason}")
    if plan.choices:
        lines.append("")
        lines.append("knobs chosen:")
        for choice in plan.choices:
            lines.append(f"  {choice.key} = {choice.value}: {choice.why}")
    if plan.step_seconds is not None:
        fraction = attention_fraction(plan.config, knobs.context)
        lines.append(f"estimated step: {plan.step_seconds:.3f} s (Rates: measured rates, "
                     f"docs/plan.md; attention within documents, {fraction:.1%} of full causal "
                     f"at {knobs.context:,} tokens, from the config's data)")
    if plan.device_memory is not None:
        for label, p in ((_label(plan), plan), ("baseline", base)):
            if p is not None:
                found = "none" if p.largest_context is None else f"{p.largest_context:,} tokens"
                lines.append(f"largest context that fits, {label} (batch {knobs.batch_size}): "
                             f"{found}")
    return "\n".join(lines)



def _label(plan) -> str:
    """The plan's row: "operators on" as configured, "auto" where the planner chose some."""
    return "auto" if any(c.why.startswith("auto: ") for c in plan.choices) else "operators on"
