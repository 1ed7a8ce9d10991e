"""``operators: auto``: the planner turns an operator on only where the run's peak needs it."""

import itertools

import pytest

from peakflat_jax.config import ConfigError, load_config
from peakflat_jax.model.attention import sequence_multiple
from peakflat_jax.plan import make_plan
from peakflat_jax.plan.operators import CHOICES, describe
from peakflat_jax.train.trainer import Trainer, runtime_for

GIB = 2**30
H200 = dict(device_memory=139 * GIB, host_memory=128 * GIB, platform="gpu")
SWITCHES = tuple(CHOICES)


def plan_of(overrides, **memory):
    config = load_config("h200-1", overrides)
    return make_plan(config, 1, baseline=False, search_context=False, **{**H200, **memory})


def chosen(plan):
    return {name: getattr(plan.config.operators, name) for name in SWITCHES}


def forced(settings):
    return [f"operators.{name}={str(value).lower()}" for name, value in settings.items()]


def test_where_the_standard_stack_fits_nothing_is_on():
    """h200-1 at 64K on one H200: the standard stack fits, so auto is the standard stack, to
    the byte."""
    plan = plan_of([])
    assert chosen(plan) == {name: values[0] for name, values in CHOICES.items()}
    standard = plan_of(forced({name: values[0] for name, values in CHOICES.items()}))
    assert plan.total_bytes == standard.total_bytes and plan.feasible
    assert "nothing binds" in describe(plan.choices)


@pytest.mark.parametrize("position", [1 / 3, 2 / 3], ids=["a third in", "two thirds in"])
def test_where_it_does_not_the_chosen_set_fits_and_none_fits_faster(position):
    """Past the standard stack's longest context and within ours': the chosen set fits, the
    standard stack does not, and of every setting of the four switches that fits none has a
    shorter estimated step (nor, at the same time, fewer operators on)."""
    standard = make_plan(load_config("h200-1", forced({n: v[0] for n, v in CHOICES.items()})),
                         1, baseline=False, **H200).largest_context
    ours = make_plan(load_config("h200-1"), 1, baseline=False, **H200).largest_context
    step = sequence_multiple("cudnn")
    context = int(standard + position * (ours - standard)) // step * step
    assert standard < context <= ours
    plan = plan_of([f"data.seq_len={context}"])
    assert plan.feasible
    assert not plan_of([f"data.seq_len={context}",
                        *forced({n: v[0] for n, v in CHOICES.items()})]).feasible
    on = sum(chosen(plan)[n] != CHOICES[n][0] for n in SWITCHES)
    assert on >= 1
    for values in itertools.product(*CHOICES.values()):
        other = plan_of([f"data.seq_len={context}", *forced(dict(zip(SWITCHES, values)))])
        if other.feasible:
            other_on = sum(v != CHOICES[n][0] for n, v in zip(SWITCHES, values))
            assert (other.step_seconds, other_on) >= (plan.step_seconds, on)


def test_a_forced_operator_stays():
    plan = plan_of(["operators.loss=ring"])
    assert plan.config.operators.loss == "ring"
    assert plan.config.operators.moe_dispatch == "ep"  # still auto: off at 64K


@pytest.mark.parametrize("overrides, lightest", [
    # h200-1 at 1M tokens: every operator on is the lightest.
    ([], len(SWITCHES)),
    # one document a sequence (one cuDNN run): every operator on is the lightest
    (["data.max_segments=1"], len(SWITCHES)),
], ids=["four segments", "one segment"])
def test_where_nothing_fits_the_smallest_peak_is_taken_and_said(overrides, lightest):
    """No setting fits at 1M tokens: the chooser takes the setting with the smallest peak of the
    16, and the banner says which (every auto operator on only where they are)."""
    plan = plan_of(["data.seq_len=1048576", *overrides])
    assert not plan.feasible
    peaks = {values: plan_of(["data.seq_len=1048576", *overrides,
                              *forced(dict(zip(SWITCHES, values)))]).total_bytes
             for values in itertools.product(*CHOICES.values())}
    assert plan.total_bytes == min(peaks.values())
    on = sum(chosen(plan)[n] != CHOICES[n][0] for n in SWITCHES)
    assert on == lightest
    line = describe(plan.choices)
    assert "no setting fits" in line and "smallest peak" in line
    assert ("every auto operator is on" in line) == (on == len(SWITCHES))
    for choice in plan.choices:
        name = choice.key.removeprefix("operators.")
        if name in CHOICES:
            state = "off" if choice.value == CHOICES[name][0] else "on"
            assert choice.why.startswith(f"auto: {state}; ")


def test_the_yaml_shorthand_and_unresolved_configs(tmp_path):
    path = tmp_path / "auto.yaml"
    path.write_text("model:\n  num_layers: 2\noperators: auto\n")
    config = load_config(path)
    assert config.operators.chosen_by_planner == SWITCHES
    with pytest.raises(ConfigError, match="still auto"):
        runtime_for(config, None)


def test_the_trainer_runs_the_plans_choice():
    """On the 8 CPU devices, tiny with its operators left to the planner: they fit in the
    CPU's share of the host, so the trainer's config is the standard stack's."""
    trainer = Trainer(load_config("tiny", ["model.num_layers=2", "data.seq_len=64",
                                           *[f"operators.{n}=auto" for n in SWITCHES]]))
    assert chosen(trainer.plan) == {name: values[0] for name, values in CHOICES.items()}
    assert trainer.config.operators.chosen_by_planner == ()
    assert not trainer.offloaded_optimizer and not any(trainer.offload)


@pytest.mark.parametrize("overrides, loop", [
    ([], "scan"),  # nothing streams: one layer compiled whatever the depth
    (["operators.optimizer_offload=true"], "unrolled"),  # overlapped: straight-line copies
    (["operators.optimizer_offload=true", "operators.optimizer_overlap=false"], "scan"),
    (["operators.optimizer_offload=true", "operators.layer_loop=scan"], "scan"),  # forced
])
def test_the_layer_loop_follows_the_optimizer_stream(overrides, loop):
    assert plan_of(overrides).config.operators.layer_loop == loop


def test_on_a_cpu_the_layer_loop_is_scanned():
    """XLA:CPU lowers the host copies to nothing: nothing to overlap, one layer compiled."""
    plan = plan_of(["operators.optimizer_offload=true"], platform="cpu")
    assert plan.config.operators.layer_loop == "scan"


# ----------------------------------------------------------------------------------------------
# The host-CPU optimizer (optimizer.update_on: host_cpu): the baseline's placement, never auto's.


@pytest.mark.parametrize("context", [65536, 196608, 1048576], ids=["fits", "binds", "none"])
def test_auto_never_puts_the_optimizer_on_the_host_cpu(context):
    """Wherever the standard stack fits, binds or nothing fits, auto's optimizer is on the
    device or streamed; and --auto's at the longest context it finds."""
    assert plan_of([f"data.seq_len={context}"]).config.optimizer.update_on == "device"
    if context == 65536:
        searched = make_plan(load_config("h200-1"), 1, auto=True, baseline=False,
                             search_context=False, **H200)
        assert searched.filled_config().optimizer.update_on == "device"


def test_with_host_cpu_the_stream_stays_off_and_the_state_leaves_the_device():
    """With optimizer.update_on: host_cpu, optimizer_offload: auto resolves to false (said in
    a choice), --auto never streams either; what the device holds throughout is the device
    AdamW's less its fp32 master and moments (12 bytes a parameter), which are host terms now;
    and the step estimate adds the host's update and the copies (gradients down, params
    up)."""
    from peakflat_jax.plan import Rates, model_weights

    off = [f"operators.{n}={str(v[0]).lower()}" for n, v in CHOICES.items()
           if n != "optimizer_offload"]
    host = plan_of([*off, "optimizer.update_on=host_cpu"])
    assert host.config.operators.optimizer_offload is False
    choice = next(c for c in host.choices if c.key == "operators.optimizer_offload")
    assert choice.value is False and "host_cpu" in choice.why
    device = plan_of([*off, "operators.optimizer_offload=false"])
    params = model_weights(host.config.model, 1).param_count
    terms = {t.name: t.bytes for t in host.terms}
    def persistent(plan):
        return sum(t.bytes for t in plan.terms if t.live == "persistent")

    assert persistent(device) - persistent(host) == 12 * params  # bf16: master 4, moments 8
    assert "master" not in terms and "moments" not in terms
    assert "host.optimizer_state" not in terms  # not the pinned pool's: the CPU backend's
    assert terms["host.cpu_adamw_state"] == 12 * params
    largest = model_weights(host.config.model, 1).largest_leaf  # one leaf's clipped fp32
    assert terms["host.cpu_adamw_transit"] == 2 * params + 4 * largest  # and the bf16 grads
    rates = Rates()
    extra = params * rates.host_adamw_seconds_per_param + 2 * 2 * params / rates.host_link_bytes
    assert host.step_seconds - device.step_seconds == pytest.approx(extra, rel=1e-9)
    config = load_config("h200-1", ["optimizer.update_on=host_cpu"])
    searched = make_plan(config, 1, auto=True, baseline=False, search_context=False, **H200)
    assert searched.knobs.optimizer_offload is False
    assert searched.filled_config().optimizer.update_on == "host_cpu"
    assert make_plan(config, 1, baseline=False, **H200).largest_context > make_plan(
        load_config("h200-1", ["operators.optimizer_offload=false"]), 1, baseline=False,
        **{**H200}).largest_context


def _e2e(context: int):
    config = load_config("h200-e2e", [f"data.seq_len={context}"])
    return make_plan(config, 1, baseline=False, search_context=False, platform="gpu",
                     device_memory=int(132.8 * GIB), host_memory=125 * GIB)


def test_every_context_below_the_largest_fits():
    """The largest context is searched by bisection, which assumes that a fit implies every
    smaller one fits: the operators' choice keeps it so (sampled every 64K)."""
    config = load_config("h200-e2e")
    largest = make_plan(config, 1, baseline=False, platform="gpu",
                        device_memory=int(132.8 * GIB), host_memory=125 * GIB).largest_context
    assert largest > 262144
    assert all(_e2e(context).feasible for context in range(32768, largest + 1, 65536))


@pytest.mark.parametrize("name, overrides", [
    ("h200-e2e", []),
    # All the optimizer's state resident: the operators' variants hold it on the device too.
    ("h200-1", ["optimizer.resident_groups=8"]),
], ids=["h200-e2e", "h200-1 state resident"])
def test_the_largest_context_is_where_some_setting_still_fits(name, overrides):
    """The largest context of an ``auto`` config is searched over the settings that trade the
    device's memory for the host's and the standard stack (plan.operators.capable_variants):
    held against every one of the 16 settings of the four switches, forced, at that context
    and the next multiple. h200-e2e on an H200 (132.8 GiB, 124.8 of host), and h200-1 with its
    streamed optimizer's state all resident."""
    memory = dict(device_memory=int(132.8 * GIB), host_memory=int(124.8 * GIB), platform="gpu")
    largest = make_plan(load_config(name, overrides), 1, baseline=False,
                        **memory).largest_context
    step = sequence_multiple("cudnn")  # what the planner's contexts are multiples of here

    def any_fits(context):
        for values in itertools.product(*CHOICES.values()):
            settings = dict(zip(SWITCHES, values))
            # Nothing streamed, nothing resident (what auto does with the optimizer off; a
            # config that forces it off refuses resident groups).
            kept = [o for o in overrides if settings["optimizer_offload"]
                    or not o.startswith("optimizer.resident_groups")]
            forced_config = load_config(name, [*kept, f"data.seq_len={context}",
                                               *forced(settings)])
            if make_plan(forced_config, 1, baseline=False, search_context=False,
                         **memory).feasible:
                return True
        return False

    assert largest is not None and any_fits(largest)
    assert make_plan(load_config(name, [*overrides, f"data.seq_len={largest}"]), 1,
                     baseline=False, search_context=False, **memory).feasible
    assert not any_fits(largest + step)
