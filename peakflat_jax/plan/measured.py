"""The constants of the closed form that only a measurement gives, read from one data file.

What a program holds is derived from its structure (``terms``); what the machine around it
holds, and how fast it runs, is not: a trainer process's resident runtime, what the kernel keeps
for page-locked memory, the fixed scratch of a cuDNN graph, the rates the step estimate ranks
candidates by, and how far XLA's compiled plan has been from the closed form (the margin a plan
states). Those live in ``measured.json``, one entry per (platform, device kind, jax version),
each value naming the record it comes from. A plan outside every measured key takes its
platform's default entry and says so (``Measured.note``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

MEASURED_FILE = pathlib.Path(__file__).with_name("measured.json")


@functools.cache
def _entries() -> tuple[dict, ...]:
    return tuple(json.loads(MEASURED_FILE.read_text())["entries"])


def _values(section: dict) -> dict:
    return {name: item["value"] for name, item in section.items()}


_DEFAULT_RATES = _values(next(e for e in _entries()
                              if e["platform"] == "gpu" and e.get("default"))["rates"])


@dataclasses.dataclass(frozen=True)
class Rates:
    """What the step-time estimate uses, per device (``measured.json``'s ``rates``; the
    defaults: the GPU default entry's). Override with ``dataclasses.replace`` or
    ``peakflat plan --rate NAME=VALUE``."""

    matmul_flops: float = _DEFAULT_RATES["matmul_flops"]
    """Dense matmul FLOP/s in the model's dtype."""
    attention_flops: float = _DEFAULT_RATES["attention_flops"]
    """Causal attention model FLOP/s, forward + backward, at long context."""
    host_link_bytes: float = _DEFAULT_RATES["host_link_bytes"]
    """Host <-> device bytes/s, both directions together."""
    all_to_all_bytes: float = _DEFAULT_RATES["all_to_all_bytes"]
    """all_to_all buffer bytes/s per device."""
    optimizer_seconds_per_param: float = _DEFAULT_RATES["optimizer_seconds_per_param"]
    """OffloadStreamAdamW's step per streamed parameter."""
    optimizer_bucket_params: int = int(_DEFAULT_RATES["optimizer_bucket_params"])
    """The bucket size of that measurement: ``--auto``'s first choice."""
    moe_chunk_seconds: float = _DEFAULT_RATES["moe_chunk_seconds"]
    """One more MoE chunk, per layer, forward + backward."""
    host_adamw_seconds_per_param: float = _DEFAULT_RATES["host_adamw_seconds_per_param"]
    """The host-CPU AdamW's update per parameter (``optimizer.update_on: host_cpu``)."""


@dataclasses.dataclass(frozen=True)
class Measured:
    """One entry of ``measured.json``: the constants of a (platform, device kind, jax)."""

    platform: str
    device_kind: str
    jax: str
    constants: dict
    """name -> value (bytes or a ratio)."""
    rates: Rates
    margin: dict
    """"device" / "host" -> (low, high): measured over the closed form."""
    note: str = ""
    """Empty where the key matched; else what the plan took instead, and why."""

    def constant(self, name: str):
        """A constant of this entry. An entry without it is refused, naming the constant and
        the entry (a card added without a measurement would otherwise plan it as zero)."""
        if name not in self.constants:
            raise KeyError(f"plan/measured.json: the {self.platform} entry of "
                           f"{self.device_kind} (jax {self.jax}) has no {name!r}")
        return self.constants[name]

    def margin_text(self, kind: str = "device") -> str:
        """One phrase for a report: the margin of ``kind`` measured here, or that none was."""
        if kind not in self.margin:
            return f"no {kind} margin measured on {self.device_kind}"
        low, high = self.margin[kind]
        return (f"measured {low:.2f}-{high:.2f}x of the closed form on {self.device_kind}, "
                f"jax {self.jax}")


def _rates_of(entry: dict) -> Rates:
    source = entry
    if "rates" not in entry:
        source = next(e for e in _entries() if e["device_kind"] == entry["rates_from"])
    values = _values(source["rates"])
    values["optimizer_bucket_params"] = int(values["optimizer_bucket_params"])
    return Rates(**values)


@functools.cache
def measured_for(platform: str, device_kind: str | None = None,
                 jax_version: str | None = None) -> Measured:
    """The entry for ``platform`` and ``device_kind`` (None: the platform's default entry) at
    ``jax_version`` (None: not checked); where none matches, the platform's default, with a
    ``note`` saying that the constants were measured elsewhere."""
    entries = [e for e in _entries() if e["platform"] == platform]
    if not entries:
        raise ValueError(f"platform: no measured entry for {platform!r}")
    default = next(e for e in entries if e.get("default"))
    matched = ([default] if device_kind is None
               else [e for e in entries if e["device_kind"] == device_kind])
    # Of the card's entries, the one measured with this jax where there is one.
    same_jax = [e for e in matched if jax_version is not None and e["jax"] == jax_version]
    entry = (same_jax or matched or [default])[0]
    notes = []
    if not matched:
        notes.append(f"{device_kind} is not measured: {entry['device_kind']}'s constants")
    if jax_version is not None and jax_version != entry["jax"]:
        notes.append(f"measured with jax {entry['jax']}, this is {jax_version}")
    margin = {kind: (item["low"], item["high"]) for kind, item in entry["margin"].items()}
    return Measured(platform=platform, device_kind=entry["device_kind"], jax=entry["jax"],
                    constants=_values(entry["constants"]), rates=_rates_of(entry),
                    margin=margin, note="; ".join(notes))


def default_rates() -> Rates:
    """The GPU default entry's rates (what ``Rates`` defaults to in the step estimate)."""
    return measured_for("gpu").rates
