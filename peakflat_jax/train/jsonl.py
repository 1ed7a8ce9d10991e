"""A JSONL file as a random-access source of texts: one JSON object a line, each holding the
text fields that ``data.text_field`` (documents) or ``data.prompt_field`` and
``data.response_field`` (chat examples) name.

``index_jsonl`` reads the file once: it finds the lines (blank ones are skipped), parses each
and checks that it is an object whose named fields are strings, so that a bad line is refused
when the pipeline is made, naming its line number and the field, and not hours into a run when
the shuffle reaches it. It keeps only where each line starts and ends (16 bytes a line); the
file is memory-mapped, and ``JsonlLines[i]`` reads line i again when the pipeline asks for it
(Grain's ``MapDataset.source`` wants ``len`` and ``[]``; its shuffle is a permutation of the
indices). The file itself is never held in Python memory, so its size is not bounded by the
host's.

Why so. Holding the parsed examples, like the corpus's documents, would cost the file's size
several times over in Python objects; holding the index costs 16 bytes an example and parsing
a line twice (once to check, once to use) costs little beside tokenizing it.
"""

from __future__ import annotations

import functools
import json
import mmap
import pathlib

import numpy as np

from peakflat_jax.config import ConfigError

_SCAN_BYTES = 1 << 26
"""How much of the file one pass of the newline search looks at (its bool mask's bytes)."""
_CHECK_LINES = 1 << 16
"""Lines whose bounds are Python ints at once while they are checked."""


class JsonlLines:
    """The non-blank lines of a JSONL file, by index: ``lines[i]`` is line i's bytes."""

    def __init__(self, path: pathlib.Path, starts: np.ndarray, ends: np.ndarray,
                 mapped: mmap.mmap):
        self.path = path
        self.starts, self.ends = starts, ends
        self._mapped = mapped
        lengths = ends - starts
        self.longest = int(lengths.max())
        """The longest line's bytes."""
        self.total_bytes = int(lengths.sum())
        """The lines' bytes."""

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> bytes:
        return self._mapped[self.starts[index]:self.ends[index]]



def index_jsonl(path: str, fields: tuple[tuple[str, str], ...]) -> JsonlLines:
    """The lines of the JSONL file at ``path`` (``data.path``), each checked to be an object
    holding the string fields ``fields``: (config key, field name) pairs, such as
    ``(("data.text_field", "text"),)``. Raises ConfigError naming ``data.path`` (no such file,
    no example, a line that is not a JSON object) or the field's key (a line without the field,
    or whose value is not a string), with the line's number."""
    file = pathlib.Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"data.path: no such file {str(file)!r}")
    stat = file.stat()
    return _indexed(str(file), stat.st_size, stat.st_mtime_ns, fields)


@functools.lru_cache(maxsize=8)
def _indexed(path: str, size: int, mtime_ns: int,
             fields: tuple[tuple[str, str], ...]) -> JsonlLines:
    """One index per file version and fields (the planner and the trainer share it)."""
    del mtime_ns  # in the cache key only: a rewritten file is read again
    file = pathlib.Path(path)
    if size == 0:
        raise ConfigError(f"data.path: {path!r} holds no example (it is empty)")
    with open(file, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    starts, ends = _line_bounds(mapped, size)
    keep = np.zeros(len(starts), bool)
    for first in range(0, len(starts), _CHECK_LINES):  # a few Python ints at a time
        bounds = zip(starts[first:first + _CHECK_LINES].tolist(),
                     ends[first:first + _CHECK_LINES].tolist())
        for index, (start, end) in enumerate(bounds, first):
            line = mapped[start:end]
            if line.strip():
                _check_line(line, index + 1, path, fields)
                keep[index] = True
    if not keep.any():
        raise ConfigError(f"data.path: {path!r} holds no example (only blank lines)")
    return JsonlLines(file, starts[keep], ends[keep], mapped)


def _line_bounds(mapped: mmap.mmap, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) of every line, int64, the newline (and a CR before it) excluded."""
    view = np.frombuffer(mapped, np.uint8)
    newlines = np.concatenate([
        offset + np.flatnonzero(view[offset:offset + _SCAN_BYTES] == ord("\n"))
        for offset in range(0, size, _SCAN_BYTES)]).astype(np.int64)
    starts = np.concatenate([[0], newlines + 1])
    ends = np.concatenate([newlines, [size]])
    if starts[-1] == size:  # the file ends with a newline: no line after it
        starts, ends = starts[:-1], ends[:-1]
    crlf = np.zeros(len(ends), bool)
    nonempty = ends > starts
    crlf[nonempty] = view[ends[nonempty] - 1] == ord("\r")
    return starts, ends - crlf


def _check_line(line: bytes, number: int, path: str, fields: tuple[tuple[str, str], ...]):
    where = f"line {number} of {path!r}"
    try:
        example = json.loads(line)
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
        raise ConfigError(f"data.path: {where} is not JSON ({error})") from None
    if not isinstance(example, dict):
        raise ConfigError(f"data.path: {where} holds a {type(example).__name__}, expected a "
                          f"JSON object")
    for key, name in fields:
        if name not in example:
            raise ConfigError(f"{key}: {where} has no field {name!r} (its fields: "
                              f"{sorted(example)})")
        if not isinstance(example[name], str):
            raise ConfigError(f"{key}: {where}: {name!r} holds a "
                              f"{type(example[name]).__name__}, expected a string")
