"""The training data pipeline (peakflat_jax/train/data.py): packing against a plain reference
packer on handmade corpora, the targets rule, seeds, exact resume (JSON states and orbax),
process sharding, the synthetic source, the host-memory bound and the errors."""

import dataclasses
import gc
import json
import pathlib
import time
import tracemalloc

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest

from peakflat_jax.config import ConfigError, DataConfig
from peakflat_jax.train import data as pf_data
from peakflat_jax.train.data import BOS, EOS, IGNORE, PAD

KEYS = ("tokens", "targets", "segment_ids", "positions")


def write_corpus(path: pathlib.Path, rng, lengths, *, distinct: bool = True) -> list[bytes]:
    """A corpus of random lower-case documents of the given lengths (bytes, at least 1),
    separated by blank lines; returns the documents. ``distinct``: document i opens with the
    i-th letter, so that its first byte names it (at most 26 documents)."""
    documents = [bytes(rng.integers(97, 123, int(length)).astype(np.uint8)) for length in lengths]
    if distinct:
        assert len(documents) <= 26
        documents = [bytes([97 + i]) + document[1:] for i, document in enumerate(documents)]
    path.write_bytes(b"\n\n".join(documents) + b"\n")
    return documents


def take(iterator, count: int) -> list[dict]:
    return [next(iterator) for _ in range(count)]


def assert_batches_equal(actual: list[dict], expected: list[dict]):
    assert len(actual) == len(expected)
    for step, (got, want) in enumerate(zip(actual, expected)):
        assert set(got) == set(KEYS)
        for key in KEYS:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"step {step}, {key}")


def stream_documents(rows: np.ndarray, segment_ids: np.ndarray) -> list[np.ndarray]:
    """The documents (token arrays from BOS on) in the order the packed rows hold them, the last
    one possibly cut short."""
    stream = np.concatenate([row[ids > 0] for row, ids in zip(rows, segment_ids)])
    starts = np.flatnonzero(stream == BOS)
    assert starts[0] == 0
    return np.split(stream, starts[1:])


def reference_pack(documents: list[np.ndarray], seq_len: int, max_segments: int,
                   count: int, *, pad_token: int = PAD,
                   masks: list[np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The first ``count`` sequences of concatenate-then-split packing, written plainly: fill a
    sequence with pieces of documents in order until it has seq_len tokens or max_segments
    pieces; pad the rest; a piece's targets are its own next tokens, its last one IGNORE.
    ``masks``: per document, 1 where a token may be a target (chat examples), IGNORE instead
    where it may not."""
    out = {key: [] for key in KEYS}
    tokens, targets, segment_ids, positions = [], [], [], []
    if masks is None:
        masks = [np.ones(len(document), int) for document in documents]

    def close():
        pad = seq_len - len(tokens)
        out["tokens"].append(tokens + [pad_token] * pad)
        out["targets"].append(targets + [IGNORE] * pad)
        out["segment_ids"].append(segment_ids + [0] * pad)
        out["positions"].append(positions + [0] * pad)

    for document, mask in zip(documents, masks):
        rest, rest_mask = list(document), list(mask)
        while rest:
            if len(tokens) == seq_len or (segment_ids and segment_ids[-1] == max_segments):
                close()
                tokens, targets, segment_ids, positions = [], [], [], []
                if len(out["tokens"]) == count:
                    return {key: np.array(value) for key, value in out.items()}
            room = seq_len - len(tokens)
            piece, rest = rest[:room], rest[room:]
            piece_mask, rest_mask = rest_mask[:room], rest_mask[room:]
            segment = (segment_ids[-1] if segment_ids else 0) + 1
            tokens += piece
            targets += [token if flag else IGNORE
                        for token, flag in zip(piece[1:], piece_mask[1:])] + [IGNORE]
            segment_ids += [segment] * len(piece)
            positions += list(range(len(piece)))
    raise AssertionError("the reference ran out of documents")


# ----------------------------------------------------------------------------------------------
# The corpus and its documents.


def test_shipped_corpus():
    info = pf_data.describe(DataConfig())
    assert pathlib.Path(info["path"]) == pf_data.DEFAULT_CORPUS
    assert pf_data.DEFAULT_CORPUS.stat().st_size < 1_000_000
    assert info["documents"] == 50 + 40  # the chapters of Genesis and Exodus
    documents = pf_data.read_documents(None)
    assert documents[0].startswith(b"Genesis 1\n1 In the beginning God created")
    assert documents[-1].startswith(b"Exodus 40\n")
    assert info["tokens"] == info["bytes"] + 2 * info["documents"]
    assert info["longest_document"] == max(len(document) for document in documents)
    pf_data.DEFAULT_CORPUS.read_bytes().decode("utf-8")


def test_documents_split_on_blank_lines(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"\n\none\nline two\n\n\n\nthree \r\n \t \r\n  four\n\n\xc3\xa9 five\n \n")
    assert pf_data.read_documents(str(path)) == [b"one\nline two", b"three", b"four",
                                                 "é five".encode()]


def test_document_level_splits_at_runs_of_blank_lines(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"a\n\nb\n \n\nc\n\n\n\nd\n\ne\n")
    assert pf_data.read_documents(str(path), 1) == [b"a", b"b", b"c", b"d", b"e"]
    assert pf_data.read_documents(str(path), 2) == [b"a\n\nb", b"c", b"d\n\ne"]
    assert pf_data.read_documents(str(path), 3) == [b"a\n\nb\n \n\nc", b"d\n\ne"]
    with pytest.raises(ConfigError, match="^data.document_blank_lines: expected a positive"):
        pf_data.read_documents(str(path), 0)


def test_a_book_a_document_fills_long_sequences_with_one_text():
    """The shipped corpus at document_blank_lines 2: its two books, each holding its chapters;
    a 4,096-token sequence of it is one segment (both books are longer), and its chapters are
    the documents of level 1."""
    chapters = pf_data.read_documents(None, 1)
    books = pf_data.read_documents(None, 2)
    assert [book[:9] for book in books] == [b"Genesis 1", b"Exodus 1\n"]
    assert b"\n\n".join(books) == b"\n\n".join(chapters)
    assert pf_data.describe(DataConfig(document_blank_lines=2))["documents"] == 2
    data = DataConfig(seq_len=4096, batch_size=2, max_segments=4, document_blank_lines=2)
    for batch in take(pf_data.make_batches(data, vocab_size=260), 3):
        assert np.all(batch["segment_ids"] == 1)  # one text, no document boundary
    chapter_level = next(pf_data.make_batches(dataclasses.replace(data, document_blank_lines=1),
                                              vocab_size=260))
    assert chapter_level["segment_ids"].max() > 1


def test_next_token_targets_rule():
    tokens = np.array([[BOS, 10, 11, EOS, BOS, 20, PAD, PAD],
                       [30, 31, EOS, BOS, 40, 41, 42, 43]])
    segment_ids = np.array([[1, 1, 1, 1, 2, 2, 0, 0],
                            [1, 1, 1, 2, 2, 2, 2, 2]])
    expected = np.array([[10, 11, EOS, IGNORE, 20, IGNORE, IGNORE, IGNORE],
                         [31, EOS, IGNORE, 40, 41, 42, 43, IGNORE]])
    np.testing.assert_array_equal(pf_data.next_token_targets(tokens, segment_ids), expected)


# ----------------------------------------------------------------------------------------------
# Packing.


@pytest.mark.parametrize("seq_len, max_segments", [(16, 3), (37, 2), (64, 8), (8, 1)])
def test_packing_matches_reference(tmp_path, rng, caplog, seq_len, max_segments):
    """Short documents (the segment cap binds), documents longer than a sequence (split and
    continued), two epochs: the batches equal the plain reference packer's on the documents in
    the order the batches hold them, and every epoch holds each document once."""
    lengths = [*rng.integers(1, 4, 6), *rng.integers(5, 30, 6), 3 * seq_len + 5, 2 * seq_len - 2]
    documents = write_corpus(tmp_path / "corpus.txt", rng, lengths)
    data = DataConfig(corpus_path=str(tmp_path / "corpus.txt"), seq_len=seq_len, batch_size=4,
                      max_segments=max_segments, seed=int(rng.integers(1000)))
    # Enough sequences for two epochs and a document: a sequence that is not full ends >= 1
    # document, so there are at most (documents + tokens / T) of them.
    n = len(documents)
    tokens_needed = 2 * sum(len(document) + 2 for document in documents) + 3 * seq_len + 7
    steps = (2 * n + 2 + tokens_needed // seq_len + 1) // data.batch_size + 2
    batches = take(pf_data.make_batches(data, vocab_size=260), steps)
    got = {key: np.concatenate([batch[key] for batch in batches]) for key in KEYS}
    for key in KEYS:
        assert got[key].dtype == np.int32 and got[key].shape == (steps * 4, seq_len)

    # Which documents, in which order: every epoch is a permutation of the corpus.
    order = stream_documents(got["tokens"], got["segment_ids"])
    ids = [int(document[1]) - 97 if len(document) > 1 else 0 for document in order]
    for i, document in zip(ids[:-1], order[:-1]):  # all but the last are whole
        np.testing.assert_array_equal(document, [BOS, *documents[i], EOS])
    assert len(ids) > 2 * n
    assert sorted(ids[:n]) == sorted(ids[n:2 * n]) == list(range(n))
    assert ids[:n] != ids[n:2 * n]
    full = [np.array([BOS, *documents[i], EOS]) for i in ids + [0]]  # + one to close the last
    expected = reference_pack(full, seq_len, max_segments, steps * 4)
    for key in KEYS:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)

    # The invariants, stated directly.
    tokens, targets, segment_ids, positions = (got[key] for key in KEYS)
    assert segment_ids.max() <= max_segments
    pad = segment_ids == 0
    assert (tokens[pad] == PAD).all() and (targets[pad] == IGNORE).all()
    assert (positions[pad] == 0).all()
    assert ((segment_ids[:, 1:] == 0) | ~pad[:, :-1]).all()  # padding only at the end
    assert (segment_ids[:, 0] == 1).all()  # segment ids 1, 2, ... in steps of one
    assert np.isin(np.diff(segment_ids, axis=1)[~pad[:, 1:]], [0, 1]).all()
    starts = np.ones_like(pad)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    assert (positions[starts & ~pad] == 0).all()  # positions restart at every piece
    inside = ~starts[:, 1:] & ~pad[:, 1:]
    assert (positions[:, 1:][inside] == positions[:, :-1][inside] + 1).all()
    has_target = targets != IGNORE
    assert not has_target[:, -1].any()
    assert (segment_ids[:, 1:][has_target[:, :-1]] == segment_ids[:, :-1][has_target[:, :-1]]).all()
    assert (targets[:, :-1][has_target[:, :-1]] == tokens[:, 1:][has_target[:, :-1]]).all()
    assert not (has_target & (tokens == EOS)).any()
    continued = tokens[:, 0] != BOS  # long documents continue in the next sequence
    assert continued.any() and (positions[continued, 0] == 0).all()
    if max_segments < 4:
        assert pad.any()  # the cap closed some sequences early
        assert not [r for r in caplog.records if "limited packing" in r.getMessage()]


def test_seed_decides_the_order(tmp_path, rng):
    write_corpus(tmp_path / "corpus.txt", rng, rng.integers(5, 40, 20))
    data = DataConfig(corpus_path=str(tmp_path / "corpus.txt"), seq_len=32, batch_size=2)
    first = take(pf_data.make_batches(data, vocab_size=260), 6)
    assert_batches_equal(take(pf_data.make_batches(data, vocab_size=260), 6), first)
    other = take(pf_data.make_batches(dataclasses.replace(data, seed=1), vocab_size=260), 6)
    assert not all(np.array_equal(a["tokens"], b["tokens"]) for a, b in zip(first, other))


# ----------------------------------------------------------------------------------------------
# State, resume, processes.


@pytest.mark.parametrize("source", ["corpus", "synthetic"])
@pytest.mark.parametrize("process_count", [1, 2])
def test_exact_resume_from_json_state(tmp_path, rng, source, process_count):
    """At every step of a few epochs: the state through JSON (as Grain's orbax handler stores
    it) restored into a fresh iterator gives the same next batches. The corpus case passes
    through states where no document is open, which grain 0.2.18 alone restores wrongly."""
    write_corpus(tmp_path / "corpus.txt", rng, [1, 2, 3, 7, 11, 13, 40, 2, 1, 9])
    data = DataConfig(source=source, corpus_path=str(tmp_path / "corpus.txt"), seq_len=12,
                      batch_size=2, max_segments=2, seed=int(rng.integers(1000)))
    states = assert_resumes_exactly(data, vocab_size=260, process_count=process_count,
                                    process_index=int(rng.integers(process_count)))
    if source == "corpus":
        assert len(closed_states(states)) >= 2


def assert_resumes_exactly(data, *, vocab_size, process_count, process_index, steps=12):
    """The state at each of ``steps`` steps, through JSON (as Grain's orbax handler stores it),
    restored into a fresh iterator gives the next 3 batches the first one gave; returns the
    states."""
    def make():
        return pf_data.make_batches(data, vocab_size=vocab_size, process_index=process_index,
                                    process_count=process_count)

    iterator = make()
    states, batches = [], []
    for _ in range(steps):
        states.append(json.loads(json.dumps(iterator.get_state())))
        batches.append(next(iterator))
    batches += take(iterator, 3)
    for step, state in enumerate(states):
        fresh = make()
        fresh.set_state(state)
        assert_batches_equal(take(fresh, 3), batches[step:step + 3])
    return states


def closed_states(states):
    """The states where no document is open (the JSON-sensitive ones, grain 0.2.18)."""
    return [state for state in states
            if all(tuple(s) == (-1, -1) for s in state["remainder_slices"].values())]


def test_orbax_checkpoint_manager_restores_the_iterator(tmp_path, rng):
    """The trainer's way: the iterator saved in a Composite beside the model's arrays by
    ocp.CheckpointManager (async and not), restored into a fresh iterator; saved where no
    document is open, the state that grain 0.2.18 alone restores wrongly from JSON."""
    write_corpus(tmp_path / "corpus.txt", rng, rng.integers(1, 30, 12))
    data = DataConfig(corpus_path=str(tmp_path / "corpus.txt"), seq_len=16, batch_size=2,
                      max_segments=3)
    params = {"w": rng.standard_normal((2, 3))}
    for use_async in (False, True):
        iterator = pf_data.make_batches(data, vocab_size=260)
        for _ in range(100):  # to a step where no document is open (the JSON-sensitive state)
            next(iterator)
            if all(s == (-1, -1) for s in iterator.get_state()["remainder_slices"].values()):
                break
        else:
            raise AssertionError("no step without an open document")
        options = ocp.CheckpointManagerOptions(enable_async_checkpointing=use_async)
        directory = tmp_path / f"checkpoints_{use_async}"
        with ocp.CheckpointManager(directory, options=options) as manager:
            manager.save(5, args=ocp.args.Composite(
                params=ocp.args.StandardSave(params),
                data=grain.checkpoint.CheckpointSave(iterator)))
            manager.wait_until_finished()
        expected = take(iterator, 4)
        fresh = pf_data.make_batches(data, vocab_size=260)
        with ocp.CheckpointManager(directory) as manager:
            restored = manager.restore(manager.latest_step(), args=ocp.args.Composite(
                params=ocp.args.StandardRestore(params),
                data=grain.checkpoint.CheckpointRestore(fresh)))
        assert restored["data"] is fresh
        np.testing.assert_array_equal(restored["params"]["w"], params["w"])
        assert_batches_equal(take(fresh, 4), expected)


@pytest.mark.parametrize("source", ["corpus", "synthetic"])
def test_processes_split_the_global_batch(tmp_path, rng, source):
    """P processes' batches, concatenated in process order, are one process's batch."""
    write_corpus(tmp_path / "corpus.txt", rng, rng.integers(1, 50, 15))
    data = DataConfig(source=source, corpus_path=str(tmp_path / "corpus.txt"), seq_len=16,
                      batch_size=8, max_segments=3, seed=int(rng.integers(1000)))
    whole = take(pf_data.make_batches(data, vocab_size=260), 5)
    for process_count in (2, 8):
        parts = [take(pf_data.make_batches(data, vocab_size=260, process_index=p,
                                           process_count=process_count), 5)
                 for p in range(process_count)]
        for part in parts:
            assert part[0]["tokens"].shape == (8 // process_count, 16)
        joined = [{key: np.concatenate([part[step][key] for part in parts]) for key in KEYS}
                  for step in range(5)]
        assert_batches_equal(joined, whole)


def test_prefetch_gives_the_same_batches_and_states(tmp_path, rng):
    write_corpus(tmp_path / "corpus.txt", rng, rng.integers(1, 50, 15))
    data = DataConfig(corpus_path=str(tmp_path / "corpus.txt"), seq_len=16, batch_size=2,
                      max_segments=3)
    plain = pf_data.make_batches(data, vocab_size=260)
    ahead = pf_data.make_batches(data, vocab_size=260, prefetch=3)
    assert_batches_equal(take(ahead, 7), take(plain, 7))
    state = json.loads(json.dumps(ahead.get_state()))
    expected = take(plain, 4)
    assert_batches_equal(take(ahead, 4), expected)
    fresh = pf_data.make_batches(data, vocab_size=260, prefetch=2)
    fresh.set_state(state)
    assert_batches_equal(take(fresh, 4), expected)


# ----------------------------------------------------------------------------------------------
# The synthetic source.


def test_synthetic_tokens(rng):
    vocab_size = int(rng.integers(300, 100_000))
    data = DataConfig(source="synthetic", seq_len=64, batch_size=4, seed=int(rng.integers(99)))
    batches = take(pf_data.make_batches(data, vocab_size=vocab_size), 3)
    for batch in batches:
        tokens = batch["tokens"]
        assert all(batch[key].dtype == np.int32 and batch[key].shape == (4, 64) for key in KEYS)
        assert tokens.min() >= 0 and tokens.max() < vocab_size
        np.testing.assert_array_equal(batch["targets"][:, :-1], tokens[:, 1:])
        assert (batch["targets"][:, -1] == IGNORE).all()
        assert (batch["segment_ids"] == 1).all()
        np.testing.assert_array_equal(batch["positions"], np.tile(np.arange(64), (4, 1)))
    rows = np.concatenate([batch["tokens"] for batch in batches])
    assert len({row.tobytes() for row in rows}) == len(rows)
    # Uniform: a chi-square of 12 rows x 64 tokens over 8 bins is far below its 0.1% tail (24.3).
    counts = np.bincount(rows.ravel() * 8 // vocab_size, minlength=8)
    assert ((counts - rows.size / 8) ** 2 / (rows.size / 8)).sum() < 24.3
    assert_batches_equal(take(pf_data.make_batches(data, vocab_size=vocab_size), 3), batches)


def measured_peak(iterator) -> int:
    """tracemalloc's peak over making one batch, beyond what was allocated before."""
    next(iterator)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        batch = next(iterator)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    del batch
    return peak


@pytest.mark.parametrize("source, seq_len, batch_size, process_count, max_segments", [
    ("synthetic", 2**20, 1, 1, 1),  # long context: one row of a million tokens
    ("synthetic", 4096, 8, 2, 1),
    ("corpus", 4096, 8, 1, 32),
    ("corpus", 4096, 8, 4, 1024),
    ("corpus", 256, 32, 1, 64),
])
def test_host_memory_bound(tmp_path, rng, source, seq_len, batch_size, process_count,
                           max_segments):
    """pipeline_host_bytes against tracemalloc's peak while a batch is made. The corpus has
    documents of 2 and of 20,000 bytes, so long documents are tokenized within the measured
    batches and the segment cap binds. Measured peak / bound: synthetic 1 M x 1 0.83, 4096 x 8
    over 2 processes 0.91; corpus 4096 x 8 with S = 32 0.81, 256 x 32 with S = 64 0.50 (the
    2 KiB-per-piece allowance for Python objects is set by such small pieces), 4096 x 8 over 4
    processes with S = 1024 0.25 (that allowance is loose at large S)."""
    write_corpus(tmp_path / "corpus.txt", rng, [2] * 200 + [20_000] * 3, distinct=False)
    data = DataConfig(source=source, corpus_path=str(tmp_path / "corpus.txt"), seq_len=seq_len,
                      batch_size=batch_size, max_segments=max_segments)
    info = pf_data.describe(data)
    bound = pf_data.pipeline_host_bytes(data, process_count=process_count,
                                        longest_document=info.get("longest_document", 0))
    iterator = pf_data.make_batches(data, vocab_size=260, process_count=process_count)
    peak = max(measured_peak(iterator) for _ in range(3))
    print(f"peak {peak} bound {bound} ratio {peak / bound:.2f}")
    assert peak <= bound
    assert peak >= 4 * 4 * seq_len * batch_size // process_count  # the outputs themselves


@pytest.mark.parametrize("source", ["corpus", "synthetic"])
def test_host_memory_bound_with_prefetch(tmp_path, rng, source):
    """With 3 batches made ahead: tracemalloc's peak from the iterator's making, with the
    caller holding its first batch, while the thread fills its buffer, against the bound plus
    that held batch. Measured peak / bound: corpus 0.81 to 0.98 (as the thread's timing falls),
    synthetic 0.99: the bound is what is held (the caller's batch, three queued, and a fourth
    made while the queue is full), its margin the 4 KiB of Python objects allowed per batch."""
    write_corpus(tmp_path / "corpus.txt", rng, [2] * 200 + [20_000] * 3, distinct=False)
    data = DataConfig(source=source, corpus_path=str(tmp_path / "corpus.txt"), seq_len=4096,
                      batch_size=8, max_segments=32)
    info = pf_data.describe(data)
    held = 4 * 4 * data.seq_len * data.batch_size
    bound = held + pf_data.pipeline_host_bytes(
        data, prefetch=3, longest_document=info.get("longest_document", 0))
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        iterator = pf_data.make_batches(data, vocab_size=260, prefetch=3)
        batch = next(iterator)
        time.sleep(0.5)  # the thread makes 3 more batches (a few ms each)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    del batch, iterator
    print(f"peak {peak} bound {bound} ratio {peak / bound:.2f}")
    assert peak <= bound
    assert peak >= 4 * held  # the thread did fill its buffer


# ----------------------------------------------------------------------------------------------
# Errors.


def test_errors_name_the_key(tmp_path):
    def fails(match, data=None, error=ConfigError, **kwargs):
        with pytest.raises(error, match=match):
            pf_data.make_batches(data or DataConfig(), **{"vocab_size": 260, **kwargs})

    fails(r"data\.corpus_path: no such file '.*missing\.txt'",
          DataConfig(corpus_path=str(tmp_path / "missing.txt")))
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    fails(r"data\.corpus_path: .* is not UTF-8", DataConfig(corpus_path=str(tmp_path /
                                                                          "latin1.txt")))
    (tmp_path / "blank.txt").write_bytes(b"\n \n\t\n")
    fails(r"data\.corpus_path: .* holds no text", DataConfig(corpus_path=str(tmp_path /
                                                                            "blank.txt")))
    fails(r"data\.batch_size: 6 sequences do not split evenly over 4 processes",
          DataConfig(batch_size=6), process_index=1, process_count=4)
    fails(r"data\.batch_size", DataConfig(source="synthetic", batch_size=6), process_count=4)
    fails(r"process_index: expected 0 <= process_index < process_count = 2, got 2",
          error=ValueError, process_index=2, process_count=2)
    fails(r"process_count", error=ValueError, process_count=0)
    fails(r"prefetch", error=ValueError, prefetch=-1)
    fails(r"model\.vocab_size: the corpus source needs 260 <= vocab_size < 2\*\*31 "
          r"\(int32 tokens\), got 256", vocab_size=256)
    fails(r"model\.vocab_size: the synthetic source needs 1 <= ", DataConfig(source="synthetic"),
          vocab_size=2**31)
    fails(r"data\.seq_len: expected a positive integer, got 0", DataConfig(seq_len=0))
    fails(r"data\.max_segments", DataConfig(max_segments=0))
    fails(r"data\.seed", DataConfig(seed=-1))
    fails(r"data\.source", DataConfig(source="web"))
    with pytest.raises(ConfigError, match=r"data\.corpus_path: no such file"):
        pf_data.describe(DataConfig(corpus_path=str(tmp_path / "missing.txt")))
