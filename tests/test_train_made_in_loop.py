"""The overlapped step's MoE layers updated inside the forward, unrolled (``sco.MadeInLoop``)
or scanned (``sco.MadeInScan``): bit for bit the plain path, tied or placed in the program
where the GPU needs it; and the scanned step's program does not grow with depth."""

import chex
import jax
import pytest
from _helpers import iter_eqns, optimizer_state_values
from test_train import small_config

from peakflat_jax.train.trainer import Trainer

# Three MoE layers behind a dense one, three buckets each (more than the two slots: a slot is
# reused within a layer), clipping and a warmup schedule; every group streamed (the planner's
# choice here too, made explicit: both tests' plain runs are this one).
COMMON = ["model.num_layers=4", "optimizer.max_grad_norm=0.5", "optimizer.warmup_steps=2",
          "optimizer.bucket_params=3500", "train.steps=3", "train.checkpoints=false",
          "optimizer.resident_groups=0"]


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """The plain path's trainer (the update in the optimizer's own program) after its run, and
    its losses: what both bit-for-bit tests compare against, made once."""
    plain = Trainer(small_config(*COMMON, "operators.optimizer_overlap=false"),
                    run_dir=str(tmp_path_factory.mktemp("plain")))
    return plain, plain.run(progress=False)["losses"]


def _tie_barriers(jaxpr, buckets, hidden):
    """The optimization barriers of a jaxpr's top level that hold a bucket-shaped array and the
    hidden state, each with the primitives that read its bucket outputs (through further
    barriers)."""
    users = {}
    for eqn in jaxpr.eqns:
        for var in eqn.invars:
            if not isinstance(var, jax.extend.core.Literal):
                users.setdefault(var, []).append(eqn)

    def readers(var):
        for eqn in users.get(var, []):
            if eqn.primitive.name == "optimization_barrier":
                yield from readers(eqn.outvars[eqn.invars.index(var)])
            else:
                yield eqn.primitive.name

    ties = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "optimization_barrier":
            continue
        shapes = [tuple(v.aval.shape) for v in eqn.invars]
        if hidden in shapes and any(shape in buckets for shape in shapes):
            ties.append((eqn, {name for var, shape in zip(eqn.outvars, shapes)
                               if shape in buckets for name in readers(var)}))
    return ties


@pytest.mark.slow
def test_updates_made_in_the_unrolled_forward_change_no_bit(plain_run, tmp_path):
    """With the unrolled stack each MoE layer's update runs inside the forward, behind the
    layer before (``MadeInLoop``): three MoE layers of three buckets each (more than the two
    slots), clipping and a schedule give the plain path's losses, weights, router bias and
    optimizer state bit for bit; and the program ties each layer l >= 1's buckets, before they
    are copied in, to its own layer l - 1's input (a barrier whose bucket outputs the copies
    read), and, written back under the backward, each bucket's update to its layer's input.
    With the first two groups' state resident on the device, the same bits again, written back
    under the backward (the resident groups under either write-back, bit for bit against the
    streamed update: tests/test_optim_offload_stream.py)."""
    plain, expected = plain_run
    for writeback in ("forward", "backward"):
        made = Trainer(small_config(*COMMON, "operators.layer_loop=unrolled",
                                    f"operators.optimizer_writeback={writeback}"),
                       run_dir=str(tmp_path / writeback))
        assert made.overlap and made.run(progress=False)["losses"] == expected, writeback
        chex.assert_trees_all_equal(
            jax.device_get((plain.final_state.params, plain.final_state.extras,
                            plain.final_state.opt_state)),
            jax.device_get((made.final_state.params, made.final_state.extras,
                            made.final_state.opt_state)))
        _check_ties(made, writeback)
    # The outer group and the first MoE layer's kept on the device (optimizer.resident_groups):
    # the same bits, those buckets in device memory, the others on the host.
    resident = Trainer(small_config(*COMMON, "operators.layer_loop=unrolled",
                                    "operators.optimizer_writeback=backward",
                                    "optimizer.resident_groups=2"),
                       run_dir=str(tmp_path / "resident"))
    assert resident.run(progress=False)["losses"] == expected
    chex.assert_trees_all_equal(  # the leaves: the layouts differ in their residency
        jax.device_get(jax.tree.leaves((plain.final_state.params,
                                        plain.final_state.opt_state))),
        jax.device_get(jax.tree.leaves((resident.final_state.params,
                                        resident.final_state.opt_state))))
    state = resident.final_state.opt_state
    kinds = [a.sharding.memory_kind for a in state.master]
    first_streamed = state.layout.groups[2].first_bucket
    assert kinds == (["device"] * first_streamed
                     + ["pinned_host"] * (len(kinds) - first_streamed))


def _check_ties(made, writeback):
    """The ties in ``made``'s overlapped step, read off its jaxpr (the test's docstring)."""
    state = made.final_state
    batch = made.global_batch(next(made.batches))
    jaxpr = jax.make_jaxpr(made._overlapped)(state.params, state.extras, state.opt_state,
                                             state.params, batch, True).jaxpr
    layout, config = state.opt_state.layout, made.config
    hidden = (config.data.batch_size, config.data.seq_len, config.model.hidden)
    num_moe = config.model.num_layers - config.model.num_dense_layers
    groups = [layout.groups[layout.layer_group(layer)] for layer in range(num_moe)]
    assert all(len(g.bucket_sizes) > made.optimizer.slots for g in groups)
    buckets = {(n * layout.placement.num_devices,)  # global shapes
               for group in groups for n in group.bucket_sizes}
    ties = _tie_barriers(jaxpr, buckets, hidden)
    before_copies = [eqn for eqn, readers in ties if "device_put" in readers]
    assert len(before_copies) == num_moe - 1
    producers = {var: eqn for eqn in jaxpr.eqns for var in eqn.outvars}

    def origin(var):  # the hidden state the barrier holds, before its stop_gradient
        eqn = producers.get(var)
        return eqn.invars[0] if eqn is not None and eqn.primitive.name == "stop_gradient" else var

    held = {origin(next(v for v in eqn.invars if tuple(v.aval.shape) == hidden))
            for eqn in before_copies}
    assert len(held) == num_moe - 1  # each layer's own predecessor, not one input for all
    before_updates = [eqn for eqn, readers in ties if "device_put" not in readers]
    expected_updates = sum(len(g.bucket_sizes) for g in groups) if writeback == "backward" else 0
    assert len(before_updates) == expected_updates


def _host_copies_in(jaxpr, shapes) -> int:
    """The copies of buckets from host memory to the device in ``jaxpr``'s own equations (not
    its loops'): the device_puts (one a bucket: its master and moments) of a result of one of
    ``shapes``."""
    return sum(any(source.aval.memory_space == jax.memory.Space.Host
                   and target.aval.memory_space == jax.memory.Space.Device
                   and tuple(target.aval.shape) in shapes
                   for source, target in zip(eqn.invars, eqn.outvars))
               for eqn in jaxpr.eqns if eqn.primitive.name == "device_put")


@pytest.mark.slow
def test_updates_made_in_the_scanned_forward_change_no_bit(plain_run, tmp_path):
    """With the scanned stack each MoE layer's update runs inside the forward loop, in the
    iteration of the layer before (``sco.MadeInScan``), its buckets a row of the optimizer
    state's stacked blocks: three MoE layers of three buckets each (more than the two slots),
    clipping and a schedule give the plain path's losses, weights, router bias and optimizer
    state bit for bit, written back as updated and under the backward, and with the outer
    group and the first MoE layer resident (a resident block, then a streamed one). In the
    program the first MoE layer's buckets are copied in before the loops, with the outer
    group's, and every later layer's inside the loop that computes the layer before it, one
    layer's buckets per iteration."""
    plain, expected = plain_run
    cases = {"forward": [], "backward": ["operators.optimizer_writeback=backward"],
             "resident": ["optimizer.resident_groups=2", "operators.optimizer_writeback=backward"]}
    made = {}
    for name, overrides in cases.items():
        made[name] = Trainer(small_config(*COMMON, "operators.layer_loop=scan", *overrides),
                             run_dir=str(tmp_path / name))
        assert made[name].overlap and made[name].run(progress=False)["losses"] == expected, name
        final = made[name].final_state
        assert final.opt_state.layout.stack_layers
        chex.assert_trees_all_equal(
            jax.device_get((plain.final_state.params, plain.final_state.extras)),
            jax.device_get((final.params, final.extras)))
        chex.assert_trees_all_equal(optimizer_state_values(plain.final_state.opt_state),
                                    optimizer_state_values(final.opt_state))
    for name, before in (("forward", 2), ("resident", 0)):  # the groups copied before the loops
        trainer = made[name]
        state = trainer.final_state
        jaxpr = jax.make_jaxpr(trainer._overlapped)(
            state.params, state.extras, state.opt_state, state.params,
            trainer.global_batch(next(trainer.batches)), True).jaxpr
        layout = state.opt_state.layout
        devices = layout.placement.num_devices
        shapes = {(n * devices,) for g in layout.groups[:2] for n in g.bucket_sizes}
        counts = [len(g.bucket_sizes) for g in layout.groups]
        assert _host_copies_in(jaxpr, shapes) == sum(counts[:before]), name
        loops = [eqn.params["jaxpr"].jaxpr for eqn in iter_eqns(jaxpr, "scan")]
        copying = [_host_copies_in(body, shapes) for body in loops]
        # MoE layers 1 and 2 made by one loop, that of layers 0 and 1; nothing in the last's.
        assert sorted(c for c in copying if c) == [counts[2]], name


def _lowered_overlapped_step_lines(tmp_path, num_layers: int, loop: str) -> int:
    """The lines of the overlapped step's lowered program (StableHLO) for ``tiny`` at
    ``num_layers`` with every optimizer group streamed, from the abstract state: nothing is
    made or compiled."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from peakflat_jax import mesh as mop

    trainer = Trainer(small_config(f"model.num_layers={num_layers}", "optimizer.resident_groups=0",
                                   f"operators.layer_loop={loop}"), run_dir=str(tmp_path))
    state = trainer.initial_state(abstract=True)
    tokens = jax.ShapeDtypeStruct((trainer.config.data.batch_size, trainer.config.data.seq_len),
                                  "int32", sharding=mop.token_sharding(trainer.mesh))
    batch = {key: tokens for key in ("tokens", "targets", "positions", "segment_ids")}
    apply = jax.ShapeDtypeStruct((), "bool", sharding=NamedSharding(trainer.mesh, P()))
    lowered = jax.jit(trainer._overlapped).lower(state.params, state.extras, state.opt_state,
                                                 state.params, batch, apply)
    return sum(" = " in line for line in lowered.as_text().splitlines())


def test_the_scanned_overlapped_step_does_not_grow_with_depth(tmp_path):
    """The overlapped step with the optimizer streamed, scanned: its program at 8 layers within
    1.05x of its program at 3 (measured: 1.005x; the MoE layers' updates are one loop body's,
    whatever the depth), where the unrolled step's grows with every layer (past 1.3x here).
    The lowered program's size stands for XLA's compile time, which follows it (docs/compile.md:
    tiny's compile at 4 to 32 layers)."""
    scanned = [_lowered_overlapped_step_lines(tmp_path, layers, "scan") for layers in (3, 8)]
    assert scanned[1] <= 1.05 * scanned[0], scanned
    unrolled = [_lowered_overlapped_step_lines(tmp_path, layers, "unrolled") for layers in (3, 8)]
    assert unrolled[1] > 1.3 * unrolled[0], unrolled
