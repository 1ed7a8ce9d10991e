"""Text to token ids: UTF-8 bytes, or a Hugging Face ``tokenizer.json`` through the
``tokenizers`` library (``data.tokenizer``).

Bytes (``data.tokenizer`` null or ``bytes``): a text's tokens are its UTF-8 bytes 0..255; BOS =
256, EOS = 257, PAD = 258 (259 reserved), a vocabulary of 260.

A tokenizer.json (a path to the file, or to a directory holding one, such as a checkpoint's;
with ``model.from_pretrained`` set, null means that directory: ``hf.config.resolve_pretrained``
fills it in): a text's tokens are ``Tokenizer.encode(text, add_special_tokens=False).ids``. The
tokenizer's own template (Llama's ``<s>`` prefix, say) is not applied, so that BOS and EOS are
added in one place, by the data pipeline, the same way for every tokenizer and for both halves
of a chat example. Special tokens written in the text (``<|im_start|>``) are still recognised
as theirs, as ``tokenizers`` does. BOS and EOS are ``data.bos_token`` / ``data.eos_token`` (a
token's text), else the ``bos_token`` / ``eos_token`` of the ``tokenizer_config.json`` beside
the tokenizer.json, as transformers reads them; no BOS is a tokenizer without one (Qwen's), no
EOS is an error (a document must end, and a chat example's end is what teaches the model to
stop). PAD is EOS: padding has segment id 0 and no target, so its id changes no loss; it only
has to be a valid one.

The vocabulary is the largest id + 1 (added tokens included), which must not exceed
``model.vocab_size`` (checked by the data pipeline, the error naming both).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import numpy as np
import tokenizers

from peakflat_jax.config import ConfigError, DataConfig

BYTES = "bytes"
"""``data.tokenizer``'s value for byte-level tokens (null means it too, without
``model.from_pretrained``)."""
BYTE_BOS, BYTE_EOS, BYTE_PAD = 256, 257, 258
"""The byte tokenizer's specials."""
BYTE_VOCAB_SIZE = 260
"""256 bytes, BOS, EOS, PAD and one reserved id."""
ENCODE_BYTES = 256
"""Host bytes that ``tokenizers`` allocates outside Python per byte of the text it encodes (its
normalized string, alignments and Encoding: 150-170 measured for a byte-level BPE), held while
one document is encoded (``data.pipeline_host_bytes``)."""
TABLE_BYTES = 16
"""Host bytes a loaded ``tokenizers.Tokenizer`` holds per byte of its tokenizer.json (12.7
measured for a byte-level BPE of 50,000 tokens; ``data.pipeline_host_bytes``)."""


@dataclasses.dataclass(frozen=True, eq=False)
class TextTokenizer:
    """Token ids of texts, and the specials the pipeline adds around them."""

    name: str
    """``bytes``, or the tokenizer.json's path."""
    bos: int | None
    """Opens every document and example; None: nothing opens them."""
    eos: int
    """Closes every document and example."""
    pad: int
    """Fills a sequence after its last segment (never a target)."""
    vocab_size: int
    """The largest id + 1."""
    hf: tokenizers.Tokenizer | None = None
    """The ``tokenizers.Tokenizer``; None for bytes."""

    def encode(self, text: str | bytes) -> np.ndarray:
        """The ids of ``text``, no specials added: int32 from a tokenizer.json (UTF-8 bytes are
        decoded for it), or for bytes a uint8 view of the text's UTF-8 (no copy: a corpus's
        documents are bytes already)."""
        if self.hf is None:
            return np.frombuffer(text if isinstance(text, bytes) else text.encode("utf-8"),
                                 np.uint8)
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return np.array(self.hf.encode(text, add_special_tokens=False).ids, np.int32)

    def with_specials(self, ids: np.ndarray) -> np.ndarray:
        """``[BOS] + ids + [EOS]`` (no BOS where the tokenizer has none), one int32 array."""
        opening = 0 if self.bos is None else 1
        tokens = np.empty(len(ids) + opening + 1, np.int32)
        if opening:
            tokens[0] = self.bos
        tokens[opening:-1] = ids
        tokens[-1] = self.eos
        return tokens


BYTE_TOKENIZER = TextTokenizer(BYTES, BYTE_BOS, BYTE_EOS, BYTE_PAD, BYTE_VOCAB_SIZE)
"""The byte-level tokenizer."""


def is_bytes(data: DataConfig) -> bool:
    """Whether ``data`` tokenizes as bytes."""
    return data.tokenizer in (None, BYTES)


def load_tokenizer(data: DataConfig) -> TextTokenizer:
    """The tokenizer of ``data`` (module docstring). Raises ConfigError naming
    ``data.tokenizer`` (no such path, no tokenizer.json in a directory, not one ``tokenizers``
    reads), ``data.bos_token`` / ``data.eos_token`` (given with bytes, not a token of the
    tokenizer, no EOS at all)."""
    if is_bytes(data):
        for key, value in (("data.bos_token", data.bos_token),
                           ("data.eos_token", data.eos_token)):
            if value is not None:
                raise ConfigError(f"{key}: names a token of data.tokenizer; the byte-level "
                                  f"tokens have their own (BOS 256, EOS 257), got {value!r}")
        return BYTE_TOKENIZER
    path = tokenizer_file(data.tokenizer)
    versions = tuple((file.stat().st_size, file.stat().st_mtime_ns) if file.is_file() else None
                     for file in (path, path.parent / "tokenizer_config.json"))
    return _load(str(path), versions, data.bos_token, data.eos_token)


def tokenizer_file(spec: str) -> pathlib.Path:
    """The tokenizer.json that ``data.tokenizer`` names: the file, or the one in a
    directory."""
    path = pathlib.Path(spec).expanduser()
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise ConfigError(f"data.tokenizer: no tokenizer.json in {str(path)!r} (set "
                              f"data.tokenizer to a tokenizer.json, a directory holding one, or "
                              f"{BYTES})")
        return path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"data.tokenizer: no such file or directory {str(path)!r}")
    return path


@functools.lru_cache(maxsize=8)
def _load(path: str, versions: tuple, bos_token: str | None,
          eos_token: str | None) -> TextTokenizer:
    """One tokenizer per version of its files and specials (the planner and the trainer share
    it)."""
    del versions  # in the cache key only: a rewritten file is read again
    try:
        hf = tokenizers.Tokenizer.from_file(path)
    except Exception as error:  # the Rust side's errors are plain Exceptions
        raise ConfigError(f"data.tokenizer: {path!r} is not a tokenizer.json that tokenizers "
                          f"reads ({str(error).splitlines()[0] if str(error) else error!r})"
                          ) from None
    defaults = _special_tokens_of(pathlib.Path(path).parent / "tokenizer_config.json")
    ids = {}
    for name, given in (("bos", bos_token), ("eos", eos_token)):
        token = given if given is not None else defaults.get(name)
        where = (f"data.{name}_token" if given is not None else
                 f"data.{name}_token: the {name}_token of tokenizer_config.json beside {path!r}")
        if token is None:
            ids[name] = None
            continue
        ids[name] = hf.token_to_id(token)
        if ids[name] is None:
            raise ConfigError(f"{where}: {token!r} is not a token of {path!r}")
    if ids["eos"] is None:
        raise ConfigError(f"data.eos_token: {path!r} names no EOS (no eos_token in a "
                          f"tokenizer_config.json beside it): set data.eos_token to the token "
                          f"that ends a document")
    vocab_size = max(hf.get_vocab(with_added_tokens=True).values()) + 1
    return TextTokenizer(path, ids["bos"], ids["eos"], ids["eos"], vocab_size, hf)


def _special_tokens_of(path: pathlib.Path) -> dict[str, str]:
    """``bos`` and ``eos`` of a tokenizer_config.json (a string, or transformers' serialized
    AddedToken ``{"content": ...}``), where it has them."""
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"data.tokenizer: {str(path)!r} is not valid JSON: {error}") from None
    found = {}
    for name in ("bos", "eos"):
        token = config.get(f"{name}_token") if isinstance(config, dict) else None
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str):
            found[name] = token
    return found
