"""Training batches: text (a corpus file, or a JSONL file of documents or of chat examples)
tokenized and packed into sequences, or synthetic tokens, as one Grain pipeline whose iterator
state checkpoints (resume is exact).

Sources (``data.source``). ``corpus``: one text file whose documents are separated by runs of
blank lines (``data.corpus_path``; by default the King James Genesis and Exodus shipped in
``corpus/``), at least ``data.document_blank_lines`` of them: the shipped corpus separates
chapters by one blank line and its two books by two, so 1 gives a chapter a document and 2 a
book a document (the long-context presets: a sequence then holds one text as long as the book
allows, not a dozen chapters that attend only within themselves). ``jsonl``: a file of one JSON
object a line (``data.path``, read by ``jsonl.index_jsonl``), each a document (its
``data.text_field``) or a chat example (its ``data.prompt_field`` and ``data.response_field``).
``synthetic``: random tokens. Nothing is downloaded.

Tokens (``tokenizer.py``). A text's ids come from ``data.tokenizer``: its UTF-8 bytes (null or
``bytes``: 0..255, BOS = 256, EOS = 257, PAD = 258, 259 reserved, a vocabulary of 260), or a
Hugging Face tokenizer.json through ``tokenizers`` (BOS and EOS the tokenizer's, PAD = EOS). A
document is ``[BOS] + its ids + [EOS]`` (no BOS where the tokenizer has none). A chat example is
``[BOS] + the prompt's ids + the response's ids + [EOS]``, the two tokenized separately, so that
where the prompt ends is exact (the prompt carries any chat template, as text).

Packing (Grain's ``ConcatThenSplitIterDataset``). The shuffled documents are concatenated into
one stream that is cut every T tokens; a document that does not fit in what is left of a
sequence is split, and its rest opens the next sequence (the next row of the batch, or the
first row of the next batch), so there is no padding in the ordinary case. Each piece of a
document in a sequence is a segment: ``segment_ids`` count them 1, 2, ... within the sequence,
0 on padding; ``positions`` count 0, 1, ... within each piece, so a continued document's
positions RESTART at 0 in the next sequence (it is a new segment there and attends only to
itself). At most S = ``data.max_segments`` pieces share a sequence (the attention kernels take
the document boundaries as a static-size list): every piece carries a one-slot meta feature
whose packed length is S, and when the S slots are taken the sequence is closed and the rest of
it is padding (PAD tokens, segment id 0, position 0). Chat examples pack the same way.

Targets. ``targets[t] = tokens[t + 1]`` when position t + 1 is in the same segment as t, else
IGNORE = -100. So no target crosses a document boundary (EOS is never asked to predict the next
document's BOS), padding has none, and the last position of a sequence has none, including when
its document continues in the next sequence (that next token is predicted by nothing: the cost
is one target per split, and the rule stays a function of the one sequence). The loss averages
over targets != IGNORE.

The SFT loss mask. In a chat example only the response is predicted: a token is a target only
if it is one of the response's or the EOS after it (so that the model learns to stop), never
the BOS or a prompt token; ``targets[t]`` is IGNORE where token t + 1 is not predicted. The
mask is a second column of the example's tokens (``[L, 2]``: the id, 1 where predicted), so
packing cuts it where it cuts the ids, and a piece continued in the next sequence keeps its
mask; the targets are then derived from the packed sequence with the rule above and the mask.
(One feature of two columns rather than a feature of its own: Grain makes segment ids and
positions for every packed feature, so a second one would pack two more [T] arrays a sequence.)

Epochs. ``MapDataset.shuffle(seed).repeat()``: a permutation of the documents drawn from
``data.seed`` for every epoch, epochs following each other for ever (a sequence may hold the end
of one epoch and the start of the next).

Synthetic source. Uniformly random tokens in [0, V), one document per sequence
(``segment_ids`` all 1, ``positions`` 0..T-1, ``targets`` the next token, the last IGNORE); row
r of the global stream is drawn from its own generator seeded by ``(data.seed, r)``, so a batch
costs the O(B_p T) of drawing its own rows, at any T.

Processes. Every process runs the same global pipeline (global batch B = ``data.batch_size``)
and keeps rows [p B_p, (p + 1) B_p) of each batch, B_p = B / P: the P processes' batches,
concatenated in process order, are the batch that one process would see.

Iterator state. ``make_batches`` returns a ``grain.DatasetIterator``: ``get_state()`` is a small
JSON-ready dict (a document counter and where the open document was cut; never token data),
``set_state()`` restores it exactly. Grain's orbax handler saves it beside the model:
``ocp.args.Composite(..., data=grain.checkpoint.CheckpointSave(iterator))`` and restores it into
a fresh iterator with ``grain.checkpoint.CheckpointRestore(iterator)`` (one JSON file per
process).

Threads. None by default: every batch is made on the caller's thread when asked for.
``make_batches(..., prefetch=n)`` makes up to n batches ahead on one background thread (Grain's
``ThreadPrefetchIterDataset``), with the same batches and states.

Host memory: ``pipeline_host_bytes`` (per process, beyond the source: the corpus text, held
once, or the JSONL index, 16 bytes a line, the file memory-mapped; ``HOST_MEMORY_FORMULA``
states it).

Legend: B global batch (``data.batch_size``), P processes, B_p = B / P rows per process, T
sequence length (``data.seq_len``), S most segments per sequence (``data.max_segments``), V
vocabulary, L the longest document's bytes (a corpus's) or line's (a JSONL file's).

Why so. Packing is sequential (where a sequence starts depends on every sequence before it), so
processes cannot each pack a share of the documents and still form one process's batch: each
packs the whole stream, which is a copy of B T tokens per step. Concatenate-then-split rather
than first-fit bin packing because it pads only when the segment cap binds and keeps a split
document's pieces in consecutive sequences; Grain's transform does this and restores its state
by replaying at most one sequence, so it is used rather than code of our own. The targets are
derived from the packed sequence (not carried through packing) so that the boundary rule is one
line that a test can state; only the mask, which no packed sequence can recover, is carried.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import pathlib
import re
import sys
from typing import Any

import grain
import numpy as np

from peakflat_jax.config import ConfigError, DataConfig, check_data_fields
from peakflat_jax.model.size import causal_pairs
from peakflat_jax.plan.target import DataStats
from peakflat_jax.train import tokenizer as text_tokenizer
from peakflat_jax.train.jsonl import index_jsonl

BOS = text_tokenizer.BYTE_BOS
"""Opens every document (bytes)."""
EOS = text_tokenizer.BYTE_EOS
"""Closes every document (bytes)."""
PAD = text_tokenizer.BYTE_PAD
"""Fills a sequence after its last segment (bytes)."""
BYTE_VOCAB_SIZE = text_tokenizer.BYTE_VOCAB_SIZE
"""256 bytes, BOS, EOS, PAD and one reserved id."""
IGNORE = -100
"""A target that the loss skips."""

PAIRS_SAMPLE_TOKENS = 1 << 19
"""The most tokens ``causal_pairs_per_sequence`` packs (beyond its first sequence)."""

DEFAULT_CORPUS = pathlib.Path(__file__).resolve().parent / "corpus" / "kjv_genesis_exodus.txt"
"""The corpus used when ``data.corpus_path`` is None."""

HOST_MEMORY_FORMULA = (
    "corpus or jsonl documents: 4 T (3 B + 5 B_p) + 8 (L + 2) + 2048 (S + B); chat examples: "
    "4 T (4 B + 7 B_p) + 16 (L + 2) + 2048 (S + B); jsonl adds 8 L (a line, its parse); a "
    "tokenizer.json adds 48 (L + 2) + 256 L (the ids as Python ints; the Rust side's encoding) "
    "+ 16 F (its tables; F: the file's bytes); synthetic: 4 T (4 B_p + 2) + 16384; each adds "
    "prefetch Q, Q = 16 B_p T + 4096 (bytes)")
"""``pipeline_host_bytes`` as a formula. Documents: the int32 tokens, segment ids and positions
of the B packed sequences of a global batch (3 B T), this process's four outputs and the masks
and copies that make them (5 B_p T), the int32 tokens of the open document and the next one (L:
the longest document's bytes, or line's, which bound its tokens), and the Python objects of up
to S pieces and B sequences. Chat examples pack two columns (the ids and the mask: 4 B T, 16 (L
+ 2)) and split them again (7 B_p T). A JSONL line is read and parsed (its bytes and the
strings, 8 L); a tokenizer.json's ids come back as a list of Python ints (48 bytes a token,
with the arrays made of it) and its encoding is made outside Python (``tokenizer.ENCODE_BYTES``
per byte of text), beside the tables the tokenizer holds (``tokenizer.TABLE_BYTES``).
Synthetic: the four outputs and one row and one arange of temporaries. Each prefetched batch
adds Q, its four outputs and their Python objects."""

# The meta feature that gives every document piece one of the S slots of its sequence.
_SEGMENT_SLOT = "segment_slot"
# Grain's read options: no threads, no prefetch buffer.
_READ_OPTIONS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


def make_batches(data: DataConfig, *, vocab_size: int, process_index: int = 0,
                 process_count: int = 1, prefetch: int = 0) -> grain.DatasetIterator:
    """This process's batches for ever: dicts of int32 numpy arrays [B_p, T] ``tokens``,
    ``targets``, ``segment_ids``, ``positions`` (module docstring). The iterator has Grain's
    ``get_state`` / ``set_state``. ``prefetch`` > 0 makes up to that many batches ahead on one
    background thread (Grain's ThreadPrefetchIterDataset; the same batches and states); 0 makes
    each when asked for. Raises ConfigError naming the key (``data.batch_size`` when P does not
    divide it, ``data.corpus_path`` or ``data.path`` when the file is missing or unreadable, a
    JSONL field when a line lacks it, ``data.tokenizer`` when its vocabulary does not fit
    ``vocab_size``) when called, not at the first batch."""
    tokenizer = _check(data, vocab_size=vocab_size, process_index=process_index,
                       process_count=process_count)
    if prefetch < 0:
        raise ValueError(f"prefetch: expected a non-negative integer, got {prefetch}")
    rows = data.batch_size // process_count
    first_row = process_index * rows
    if data.source == "synthetic":
        batches = grain.MapDataset.range(sys.maxsize).map(functools.partial(
            _synthetic_batch, data=data, vocab_size=vocab_size, first_row=first_row,
            rows=rows)).to_iter_dataset(_READ_OPTIONS)
    else:
        batches = _packed_batches(data, tokenizer, first_row=first_row, rows=rows)
    if prefetch:
        batches = grain.experimental.ThreadPrefetchIterDataset(
            batches, prefetch_buffer_size=prefetch)
    return iter(batches)


def describe(data: DataConfig) -> dict[str, Any]:
    """A few facts for the trainer's banner: the source, and for text its path, documents (or
    examples), bytes, the tokenizer and the longest document's bytes, or line's for JSONL
    (``pipeline_host_bytes``'s L); with byte tokens, the tokens per epoch (bytes + BOS and EOS
    of each document)."""
    if data.source == "synthetic":
        return {"source": "synthetic", "tokens_per_step": data.batch_size * data.seq_len}
    check_data_fields(data)
    tokenizer = text_tokenizer.load_tokenizer(data)
    if data.source == "jsonl":
        lines = index_jsonl(data.path, _jsonl_fields(data))
        info = {"source": "jsonl", "path": str(lines.path), "documents": len(lines),
                "bytes": lines.total_bytes, "longest_document": lines.longest}
    else:
        path = _corpus_path(data.corpus_path)
        if not path.is_file():
            raise ConfigError(f"data.corpus_path: no such file {str(path)!r}")
        stat = path.stat()
        count, size, longest = _corpus_facts(str(path), stat.st_size, stat.st_mtime_ns,
                                             data.document_blank_lines)
        info = {"source": "corpus", "path": str(path), "documents": count, "bytes": size,
                "longest_document": longest}
        if tokenizer is text_tokenizer.BYTE_TOKENIZER:
            info["tokens"] = size + 2 * count
    return {**info, "tokenizer": tokenizer.name,
            "tokens_per_step": data.batch_size * data.seq_len}


def read_documents(corpus_path: str | None, blank_lines: int = 1) -> list[bytes]:
    """The documents of a UTF-8 text file (``data.corpus_path``; None: ``DEFAULT_CORPUS``):
    the text between runs of at least ``blank_lines`` blank lines (``data.document_blank_lines``;
    lines of spaces and tabs count as blank), stripped of whitespace at both ends, empty ones
    dropped. Raises ConfigError naming data.corpus_path."""
    path = _corpus_path(corpus_path)
    if not path.is_file():
        raise ConfigError(f"data.corpus_path: no such file {str(path)!r}")
    raw = path.read_bytes()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"data.corpus_path: {str(path)!r} is not UTF-8 text (byte "
                          f"{error.start}: {error.reason})") from None
    if blank_lines < 1:
        raise ConfigError(f"data.document_blank_lines: expected a positive integer, got "
                          f"{blank_lines}")
    separator = rb"\r?\n(?:[ \t]*\r?\n){%d}" % blank_lines
    documents = [document.strip() for document in re.split(separator, raw)]
    documents = [document for document in documents if document]
    if not documents:
        raise ConfigError(f"data.corpus_path: {str(path)!r} holds no text")
    return documents


@functools.lru_cache(maxsize=8)
def _corpus_facts(path: str, size: int, mtime_ns: int, blank_lines: int) -> tuple[int, int, int]:
    """(documents, bytes, the longest document's bytes) of a corpus file version, read once
    (the planner asks for every plan it weighs)."""
    del size, mtime_ns  # in the cache key only: a rewritten file is read again
    documents = read_documents(path, blank_lines)
    return (len(documents), sum(len(document) for document in documents),
            max(len(document) for document in documents))


@functools.lru_cache(maxsize=64)
def causal_pairs_per_sequence(data: DataConfig, seq_len: int | None = None) -> float:
    """The causal query-key pairs within documents (``model.size.causal_pairs``) of one
    sequence of this config's data at ``seq_len`` (default ``data.seq_len``), on average: T (T +
    1) / 2 for synthetic data (one document a sequence, exact); for text, the mean over the
    first sequences that the pipeline packs at that length, as many as an epoch's tokens fill
    (at least one, at most ``PAIRS_SAMPLE_TOKENS`` tokens beyond it; where the tokens of an
    epoch are not known without tokenizing it, its bytes + 2 a document bound them). What the
    planner's step estimate counts, by the trainer's convention."""
    t = data.seq_len if seq_len is None else seq_len
    if data.source == "synthetic":
        return t * (t + 1) / 2
    sample = dataclasses.replace(data, seq_len=t, batch_size=1)
    info = describe(sample)
    epoch = info.get("tokens", info["bytes"] + 2 * info["documents"])
    count = max(1, -(-min(epoch, PAIRS_SAMPLE_TOKENS) // t))
    vocab_size = text_tokenizer.load_tokenizer(data).vocab_size
    batches = make_batches(sample, vocab_size=vocab_size)
    return sum(causal_pairs(next(batches)["segment_ids"]) for _ in range(count)) / count


def data_stats(data: DataConfig) -> DataStats:
    """The statistics the planner needs of this data, per context: the mean causal pairs
    within documents of a sequence (``causal_pairs_per_sequence``) and the pipeline's host
    bytes (``pipeline_host_bytes``), both computed here, on first use (text data is read and
    packed then, once per context)."""
    def pairs(context: int) -> float:
        return causal_pairs_per_sequence(data, context)

    def host_bytes(context: int, batch_size: int) -> int:
        return pipeline_host_bytes(dataclasses.replace(data, seq_len=context,
                                                       batch_size=batch_size))

    source = ("synthetic: one document a sequence" if data.source == "synthetic" else
              f"{data.source}, packed as the pipeline packs it")
    return DataStats(causal_pairs=pairs, pipeline_host_bytes=host_bytes, source=source)


def next_token_targets(tokens: np.ndarray, segment_ids: np.ndarray,
                       predicted: np.ndarray | None = None) -> np.ndarray:
    """``targets[..., t] = tokens[..., t + 1]`` where t and t + 1 are in one segment (id > 0)
    and, given the SFT mask ``predicted`` (bool, the shape of ``tokens``), token t + 1 is
    predicted; else IGNORE: the rules of the module docstring."""
    targets = np.full_like(tokens, IGNORE)
    same_segment = segment_ids[..., 1:] == segment_ids[..., :-1]
    same_segment &= segment_ids[..., :-1] > 0
    if predicted is not None:
        same_segment &= predicted[..., 1:]
    np.copyto(targets[..., :-1], tokens[..., 1:], where=same_segment)
    return targets


def pipeline_host_bytes(data: DataConfig, *, process_count: int = 1, prefetch: int = 0,
                        longest_document: int | None = None) -> int:
    """Host bytes the pipeline allocates while it makes a batch, per process, beyond the source
    (module docstring) and the batch the caller still holds (``HOST_MEMORY_FORMULA``): the sum
    of ``pipeline_host_terms``. ``longest_document`` is L, in bytes; None: ``describe``'s (the
    source is read)."""
    return sum(pipeline_host_terms(data, process_count=process_count, prefetch=prefetch,
                                   longest_document=longest_document).values())


def pipeline_host_terms(data: DataConfig, *, process_count: int = 1, prefetch: int = 0,
                        longest_document: int | None = None) -> dict[str, int]:
    """``pipeline_host_bytes`` by where it is allocated: ``python``, what Python allocates (held
    against tracemalloc's peak in tests/test_data.py and tests/test_data_text.py), and
    ``tokenizer``, what a tokenizer.json's ``tokenizers`` allocates outside it (its encoding of
    the longest document and its tables; held, with the rest, against the resident memory of a
    fresh process in tests/test_data_text.py)."""
    t, b = data.seq_len, data.batch_size
    rows = b // process_count
    prefetched = prefetch * (16 * rows * t + 4096)
    if data.source == "synthetic":
        return {"python": 4 * t * (4 * rows + 2) + 16384 + prefetched, "tokenizer": 0}
    if longest_document is None:
        longest_document = describe(data)["longest_document"]
    length = longest_document
    if data.source == "jsonl" and data.prompt_field is not None:
        packing = 4 * t * (4 * b + 7 * rows) + 16 * (length + 2)
    else:
        packing = 4 * t * (3 * b + 5 * rows) + 8 * (length + 2)
    python = packing + 2048 * (data.max_segments + b) + prefetched
    if data.source == "jsonl":
        python += 8 * length
    if text_tokenizer.is_bytes(data):
        return {"python": python, "tokenizer": 0}
    table = text_tokenizer.tokenizer_file(data.tokenizer).stat().st_size
    return {"python": python + 48 * (length + 2),
            "tokenizer": text_tokenizer.ENCODE_BYTES * length + text_tokenizer.TABLE_BYTES * table}


# ----------------------------------------------------------------------------------------------
# The pieces of the pipeline.


def _corpus_path(corpus_path: str | None) -> pathlib.Path:
    return DEFAULT_CORPUS if corpus_path is None else pathlib.Path(corpus_path).expanduser()


def _jsonl_fields(data: DataConfig) -> tuple[tuple[str, str], ...]:
    """(config key, field name) of the text fields a JSONL line must hold."""
    if data.text_field is not None:
        return (("data.text_field", data.text_field),)
    return (("data.prompt_field", data.prompt_field),
            ("data.response_field", data.response_field))


def _check(data: DataConfig, *, vocab_size: int, process_index: int,
           process_count: int) -> text_tokenizer.TextTokenizer | None:
    """ConfigError (or ValueError for the process arguments) naming what is wrong; the
    tokenizer of a text source."""
    if data.source not in ("corpus", "jsonl", "synthetic"):
        raise ConfigError(f"data.source: expected 'corpus', 'jsonl' or 'synthetic', got "
                          f"{data.source!r}")
    for key, value in (("data.seq_len", data.seq_len), ("data.batch_size", data.batch_size),
                       ("data.max_segments", data.max_segments),
                       ("data.document_blank_lines", data.document_blank_lines)):
        if value < 1:
            raise ConfigError(f"{key}: expected a positive integer, got {value}")
    if data.seed < 0:
        raise ConfigError(f"data.seed: expected a non-negative integer, got {data.seed}")
    if process_count < 1:
        raise ValueError(f"process_count: expected a positive integer, got {process_count}")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index: expected 0 <= process_index < process_count = "
                         f"{process_count}, got {process_index}")
    if data.batch_size % process_count:
        raise ConfigError(f"data.batch_size: {data.batch_size} sequences do not split evenly "
                          f"over {process_count} processes")
    check_data_fields(data)
    if data.source == "synthetic":
        tokenizer, low = None, 1
    else:
        tokenizer = text_tokenizer.load_tokenizer(data)
        low = tokenizer.vocab_size
    if vocab_size < low and data.source != "synthetic" and not text_tokenizer.is_bytes(data):
        raise ConfigError(f"data.tokenizer: {tokenizer.name!r} has {low} tokens (ids up to "
                          f"{low - 1}), more than model.vocab_size = {vocab_size}")
    if not low <= vocab_size <= np.iinfo(np.int32).max:
        raise ConfigError(f"model.vocab_size: the {data.source} source needs {low} <= "
                          f"vocab_size < 2**31 (int32 tokens), got {vocab_size}")
    if data.source == "corpus" and not _corpus_path(data.corpus_path).is_file():
        raise ConfigError(f"data.corpus_path: no such file "
                          f"{str(_corpus_path(data.corpus_path))!r}")
    if data.source == "jsonl":
        index_jsonl(data.path, _jsonl_fields(data))  # every line checked now
    return tokenizer


def _packed_batches(data: DataConfig, tokenizer: text_tokenizer.TextTokenizer, *,
                    first_row: int, rows: int) -> grain.IterDataset:
    """The text pipeline: documents (or examples) shuffled, repeated, tokenized, packed,
    batched."""
    if data.source == "jsonl":
        source = index_jsonl(data.path, _jsonl_fields(data))
        features = functools.partial(_line_features, tokenizer=tokenizer, data=data)
    else:
        source = read_documents(data.corpus_path, data.document_blank_lines)
        features = functools.partial(_document_features, tokenizer=tokenizer)
    stream = (grain.MapDataset.source(source)
              .shuffle(seed=data.seed)
              .repeat()
              .map(features)
              .to_iter_dataset(_READ_OPTIONS))
    sequences = grain.experimental.ConcatThenSplitIterDataset(
        stream, length_struct={"tokens": data.seq_len, _SEGMENT_SLOT: data.max_segments},
        meta_features=(_SEGMENT_SLOT,))
    batches = _RestorableSplits(sequences).batch(
        data.batch_size, drop_remainder=True,
        batch_fn=functools.partial(_process_rows, first_row=first_row, rows=rows,
                                   pad=tokenizer.pad))
    return batches


def _document_features(document: str | bytes, *,
                       tokenizer: text_tokenizer.TextTokenizer) -> dict[str, np.ndarray]:
    """One document as Grain packs it: its tokens and one segment slot."""
    tokens = tokenizer.with_specials(tokenizer.encode(document))
    return {"tokens": tokens, _SEGMENT_SLOT: np.zeros(1, np.int32)}


def _line_features(line: bytes, *, tokenizer: text_tokenizer.TextTokenizer,
                   data: DataConfig) -> dict[str, np.ndarray]:
    """One JSONL line as Grain packs it: a document's tokens, or a chat example's tokens and
    mask ([L, 2]: the ids; 1 for the response and the EOS, 0 for the BOS and the prompt)."""
    example = json.loads(line)
    if data.text_field is not None:
        return _document_features(example[data.text_field], tokenizer=tokenizer)
    prompt = tokenizer.encode(example[data.prompt_field])
    response = tokenizer.encode(example[data.response_field])
    ids = tokenizer.with_specials(np.concatenate([prompt, response]))
    tokens = np.zeros((len(ids), 2), np.int32)
    tokens[:, 0] = ids
    tokens[len(ids) - len(response) - 1:, 1] = 1  # the response and the EOS after it
    return {"tokens": tokens, _SEGMENT_SLOT: np.zeros(1, np.int32)}


def _process_rows(sequences: list[dict[str, np.ndarray]], *, first_row: int, rows: int,
                  pad: int) -> dict[str, np.ndarray]:
    """This process's rows of a global batch of packed sequences, with PAD and targets."""
    mine = sequences[first_row:first_row + rows]
    segment_ids = np.stack([sequence["tokens_segment_ids"] for sequence in mine])
    tokens = np.stack([sequence["tokens"] for sequence in mine])
    predicted = None
    if tokens.ndim == 3:  # chat examples: the ids and the SFT mask
        predicted = tokens[..., 1] == 1
        tokens = np.ascontiguousarray(tokens[..., 0])
    tokens[segment_ids == 0] = pad
    return {"tokens": tokens, "targets": next_token_targets(tokens, segment_ids, predicted),
            "segment_ids": segment_ids,
            "positions": np.stack([sequence["tokens_positions"] for sequence in mine])}


def _synthetic_batch(step: int, *, data: DataConfig, vocab_size: int, first_row: int,
                     rows: int) -> dict[str, np.ndarray]:
    """Rows [first_row, first_row + rows) of global batch ``step`` of uniform random tokens."""
    t = data.seq_len
    tokens = np.empty((rows, t), np.int32)
    for row in range(rows):
        generator = np.random.default_rng((data.seed, step * data.batch_size + first_row + row))
        tokens[row] = generator.integers(0, vocab_size, t, dtype=np.int32)
    targets = np.full_like(tokens, IGNORE)
    targets[:, :-1] = tokens[:, 1:]
    return {"tokens": tokens, "targets": targets, "segment_ids": np.ones_like(tokens),
            "positions": np.tile(np.arange(t, dtype=np.int32), (rows, 1))}


class _RestorableSplits(grain.IterDataset):
    """Grain's concat-then-split packing with a state that survives JSON.

    Its state marks "no document open" with the tuple (-1, -1); JSON (how Grain's orbax handler
    stores states) turns it into a list, which grain 0.2.18's ``set_state`` reads as an open
    document cut at [-1:-1], so the restored iterator packs an empty segment and drops a
    document. Turning the lists back into tuples restores it exactly."""

    def __iter__(self) -> grain.DatasetIterator:
        return _RestorableSplitsIterator(self._parent.__iter__())


class _RestorableSplitsIterator(grain.DatasetIterator):
    def __next__(self):
        return next(self._parent)

    def get_state(self) -> dict[str, Any]:
        return self._parent.get_state()

    def set_state(self, state: dict[str, Any]):
        if "remainder_slices" in state:  # grain 0.2.18's state layout
            state = {**state, "remainder_slices": {
                key: tuple(value) for key, value in state["remainder_slices"].items()}}
        self._parent.set_state(state)


class _DropSegmentCapMessages(logging.Filter):
    """Grain logs an error each time a packed sequence is closed because its meta feature is
    full; for the segment slot that is the ``data.max_segments`` cap doing its work."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(f"Meta feature '{_SEGMENT_SLOT}' limited")


logging.getLogger("absl").addFilter(_DropSegmentCapMessages())
