"""scripts/xla_copy_schedule.py held to XLA:GPU's recorded schedules of h200-1's overlapped step
(issue 26: where the streamed optimizer's host copies can run under compute)."""

import pathlib
import tarfile

from _helpers import load_script

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "results"


def _script():
    return load_script("xla_copy_schedule")


def _sequence(script, archive_name, tmp_path):
    with tarfile.open(RESULTS / archive_name) as archive:
        (member,) = [m for m in archive.getmembers() if m.name.endswith("live-range.txt")]
        archive.extract(member, tmp_path, filter="data")
    return script.read_sequence(tmp_path / member.name)


def test_the_write_back_under_the_backward_leaves_half_the_forward_s_copies_bare(tmp_path):
    """All four on at 64K, written back under the backward, 8 copies in flight (the 18:58
    dump; 2.460 s a step, 894 ms of 1313 exposed): every one of the 202 write-back copies has
    heavy work between its start and its end, but 99 of the 204 copies in, which the tied update
    needs before each layer's forward, have none: nothing heavy runs while they fly, so the
    compute stream waits for each (docs/offload_adamw.md)."""
    script = _script()
    names = _sequence(script, "xla_gpu_live_ranges_h200-1_on64k_bwd_20261202.tgz", tmp_path)
    rows = script.copy_schedule(names)
    assert sum(started for _, started, _ in rows) == 406
    assert script.uncovered_copies(names) == (204, 99, 202, 0)


def test_a_copy_with_a_matmul_between_its_ends_is_covered():
    """The counting itself, on a made-up schedule: a copy over a custom call is covered, one
    whose start and end are adjacent (a barrier between them) is not, and copies started after
    the first attention's backward count as the backward's."""
    script = _script()
    names = ["copy-start.1", "custom-call.5", "copy-done.1", "copy-start.2",
             "optimization_barrier.3", "copy-done.2", "dot_product_attention_bwd.7",
             "copy-start.4", "fusion.9", "copy-done.4"]
    assert script.copy_cover(names) == {"1": 1, "2": 0, "4": 0}
    assert script.uncovered_copies(names) == (2, 1, 1, 1)
