"""The plan as ``peakflat plan`` prints it: the verdict first (one line), then the table of
terms; and as JSON."""

from __future__ import annotations

from peakflat_jax.plan.errors import GIB
from peakflat_jax.plan.programs import Plan
from peakflat_jax.plan.rates import attention_fraction
from peakflat_jax.plan.terms import LIVE_SETS, PHASES


def plan_json(plan: Plan) -> dict:
    """The plan as one JSON object: terms, total_bytes, device_bytes, feasible, the programs,
    phases, host terms, the knobs (with the rules that chose them), the largest context that
    fits, the pinned pool's cap, the margin measured, and the baseline's."""
    def one(p: Plan) -> dict:
        return {"terms": p.device_terms(), "total_bytes": p.total_bytes,
                "feasible": p.feasible, "programs": p.programs, "phases": p.phases,
                "peak_phase": p.peak_phase, "host_terms": p.host_terms(),
                "host_bytes": p.host_bytes, "reasons": p.reasons(),
                "largest_context": p.largest_context}

    measured = plan.target.measured
    out = one(plan)
    out.update({
        "verdict": verdict(plan),
        "device_bytes": plan.device_memory, "host_memory_bytes": plan.host_memory,
        "config": plan.config.name, "platform": plan.platform,
        "devices": plan.knobs.num_devices, "tokens_per_device": plan.knobs.tokens_per_device,
        "knobs": plan.knobs.as_config(),
        "choices": [{"key": c.key, "value": c.value, "why": c.why} for c in plan.choices],
        "step_seconds_estimate": plan.step_seconds,
        "step_attention_fraction": attention_fraction(plan.target, plan.knobs.context),
        "data_statistics": plan.target.data.source,
        "pinned_pool_cap_gib": plan.pinned_pool_cap_gib,
        "measured": {"device_kind": measured.device_kind, "jax": measured.jax,
                     "note": measured.note, "margin": measured.margin},
        "formulas": {t.name: t.formula for t in plan.terms},
    })
    if plan.baseline is not None:
        out["baseline"] = one(plan.baseline)
    return out


def verdict(plan: Plan) -> str:
    """One line: whether the step fits, its total against the device (and the host), the
    largest context that fits, and the closed form's measured margin."""
    def gib(value: int) -> str:
        return f"{value / GIB:,.2f}"

    name = plan.config.name
    need = f"{gib(plan.total_bytes)} GiB"
    if plan.device_memory is None:
        head = f"{name}: unknown: {need} per device, the device's memory not given"
    else:
        state = {True: "fits", False: "does NOT fit"}[bool(plan.feasible)]
        head = f"{name} {state}: {need} of {gib(plan.device_memory)} GiB per device"
        if plan.host_memory is not None:
            head += f", host {gib(plan.host_bytes)} of {gib(plan.host_memory)} GiB"
        if plan.fits_device is False:
            largest = plan.largest_term()
            head += f" (largest term {largest.name} {gib(largest.bytes)} GiB)"
        elif plan.fits_host is False:
            head += " (the host does not fit)"
    if plan.device_memory is not None:
        found = plan.largest_context
        head += ("; no context fits" if found is None and plan.feasible is False else
                 "" if found is None else f"; largest context {found:,} tokens")
    margin = plan.target.measured
    head += f" [closed form; XLA's plan {margin.margin_text('device')}"
    head += f"; {margin.note}]" if margin.note else "]"
    return head


def format_table(plan: Plan, *, formulas: bool = False) -> str:
    """The verdict, then the terms of the plan (operators on, baseline) with a short formula
    each (``formulas``: the long form), the programs' totals, the knobs chosen and the largest
    context; in GiB, or MiB for a plan under 1 GiB."""
    unit, scale = ("GiB", GIB) if plan.total_bytes >= GIB else ("MiB", 2**20)

    def amount(value: int | None) -> str:
        return "" if value is None else f"{value / scale:,.3f}"

    knobs = plan.knobs
    base = plan.baseline
    lines = [
        f"peakflat plan {verdict(plan)}",
        f"{knobs.num_devices} {plan.platform} devices (data {knobs.data} x seq {knobs.seq}), "
        f"context {knobs.context:,} x batch {knobs.batch_size} = N "
        f"{knobs.tokens_per_device:,} tokens per device; memory per device: device "
        f"{amount(plan.device_memory) or 'unknown'} {unit}, host "
        f"{amount(plan.host_memory) or 'unknown'} {unit}; attention {knobs.attention}",
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
        formula = term.formula if formulas else term.short
        lines.append(f"{name:34} {term.live:16} {amount(on[name].bytes) if name in on else '-':>12}"
                     f" {amount(off[name].bytes) if name in off else '-':>13}  {formula}")
    lines.append("")
    lines.append("peak = persistent + boundaries + backward + the largest phase; the offloaded "
                 "optimizer's step is its own program (--formulas: each term's formula)")
    for label, p in ((_label(plan), plan), ("baseline", base)):
        if p is None:
            continue
        phases = ", ".join(f"{phase} {amount(p.phases[phase])}" for phase in PHASES
                           if p.phases[phase])
        programs = ", ".join(f"{name} {amount(value)}" for name, value in p.programs.items())
        state = {True: "fits", False: "does NOT fit", None: "unknown (device memory)"}[
            p.feasible]
        lines.append(f"{label:13} total {amount(p.total_bytes)} {unit} (programs: {programs}; "
                     f"phases: {phases}); host {amount(p.host_bytes)} {unit}: {state}")
        for reason in p.reasons():
            lines.append(f"{'':13} {reason}")
    if plan.choices:
        lines.append("")
        lines.append("knobs chosen:")
        for choice in plan.choices:
            lines.append(f"  {choice.key} = {choice.value}: {choice.why}")
    if plan.step_seconds is not None:
        fraction = attention_fraction(plan.target, knobs.context)
        lines.append(f"estimated step: {plan.step_seconds:.3f} s (measured rates; attention "
                     f"{fraction:.1%} of full causal at {knobs.context:,} tokens; data "
                     f"statistics: {plan.target.data.source})")
    if plan.pinned_pool_cap_gib is not None:
        lines.append(f"pinned-host pool cap: {plan.pinned_pool_cap_gib} GiB (what peakflat "
                     f"train sets: XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB)")
    if plan.device_memory is not None:
        for label, p in ((_label(plan), plan), ("baseline", base)):
            if p is not None:
                found = "none" if p.largest_context is None else f"{p.largest_context:,} tokens"
                lines.append(f"largest context that fits, {label} (batch {knobs.batch_size}): "
                             f"{found}")
    return "\n".join(lines)


def _label(plan: Plan) -> str:
    """The plan's row: "operators on" as configured, "auto" where the planner chose some."""
    return "auto" if any(c.why.startswith("auto: ") for c in plan.choices) else "operators on"
