"""Text through a tokenizer (peakflat_jax/train/tokenizer.py) and the JSONL source
(peakflat_jax/train/jsonl.py) in the data pipeline: ids equal ``tokenizers``' own, packing
equals the plain reference packer of tests/test_data.py, the SFT mask (only the response and
its EOS are targets, also across a split), exact resume, the host-memory bound and the errors.
The tokenizer is trained here, by ``tokenizers`` itself, on a few strings: nothing is
downloaded."""

import dataclasses
import json
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tokenizers
from test_data import (
    KEYS,
    assert_batches_equal,
    assert_resumes_exactly,
    closed_states,
    measured_peak,
    reference_pack,
    take,
)

from peakflat_jax.config import ConfigError, DataConfig
from peakflat_jax.hf.config import load_config
from peakflat_jax.train import data as pf_data
from peakflat_jax.train import tokenizer as pf_tokenizer
from peakflat_jax.train.data import IGNORE

WORDS = ("the quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing "
         "matches near a frozen lake").split()
SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]


def train_tokenizer(directory: pathlib.Path, *, config: dict | None = None) -> pathlib.Path:
    """A byte-level BPE of 300 tokens (the specials, 256 bytes and merges) trained on
    sentences of WORDS, saved as directory/tokenizer.json, with a tokenizer_config.json
    holding ``config`` (default: BOS ``<s>``, EOS ``</s>``, the latter as transformers
    serializes an AddedToken)."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    sentences = [" ".join(rng.choice(WORDS, 12)) for _ in range(200)]
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(sentences, tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(directory / "tokenizer.json"))
    if config is None:
        config = {"bos_token": "<s>",
                  "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True}}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory / "tokenizer.json"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> pathlib.Path:
    directory = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(directory)
    return directory


def random_text(rng, words: int) -> str:
    """``words`` random words of WORDS, some of them capitalised or accented (bytes the BPE
    never merged)."""
    chosen = [str(word) for word in rng.choice(WORDS, words)]
    for index in rng.integers(0, words, words // 5 + 1) if words else ():
        chosen[index] = chosen[index].capitalize() + "é"
    return " ".join(chosen)


def write_jsonl(path: pathlib.Path, records: list[dict], *, blank_lines: bool = True) -> list:
    """One JSON object a line (with a blank line and a CRLF line among them); returns
    ``records``."""
    lines = [json.dumps(record) for record in records]
    if blank_lines and len(lines) > 2:
        lines[1] += "\r"
        lines.insert(2, "")
    path.write_text("\n".join(lines) + "\n")
    return records


def expected_ids(tokenizer_dir: pathlib.Path, text: str) -> list[int]:
    """``tokenizers`` applied directly: the text's ids without the tokenizer's template."""
    tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return tokenizer.encode(text, add_special_tokens=False).ids


def ids_of(tokenizer_dir: pathlib.Path, token: str) -> int:
    return tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).token_to_id(
        token)


def packed(batches: list[dict]) -> dict[str, np.ndarray]:
    return {key: np.concatenate([batch[key] for batch in batches]) for key in KEYS}


def order_of(got: dict[str, np.ndarray], documents: list[np.ndarray], bos: int) -> list[int]:
    """Which documents the packed rows hold, in order: the stream of their tokens cut at each
    BOS, each piece matched to its document; the last one may be cut short, so it is matched
    to one that it begins (the one it equals, if any: packing either gives the same rows)."""
    stream = np.concatenate([row[ids > 0] for row, ids in zip(got["tokens"],
                                                              got["segment_ids"])])
    starts = np.flatnonzero(stream == bos)
    assert starts[0] == 0
    index = {tuple(document): i for i, document in enumerate(documents)}
    assert len(index) == len(documents)  # the documents are distinct
    *whole, last = np.split(stream, starts[1:])
    order = [index[tuple(piece)] for piece in whole]
    begun = [i for i, document in enumerate(documents)
             if np.array_equal(document[:len(last)], last)]
    return order + [index.get(tuple(last), begun[0])]


# ----------------------------------------------------------------------------------------------
# The tokenizer.


def test_tokenizer_reads_its_specials_and_vocabulary(tmp_path, tokenizer_dir):
    data = DataConfig(tokenizer=str(tokenizer_dir))
    tokenizer = pf_tokenizer.load_tokenizer(data)
    assert (tokenizer.bos, tokenizer.eos) == (ids_of(tokenizer_dir, "<s>"),
                                              ids_of(tokenizer_dir, "</s>"))
    assert tokenizer.pad == tokenizer.eos and tokenizer.vocab_size == 300
    assert tokenizer.name == str(tokenizer_dir / "tokenizer.json")
    by_file = pf_tokenizer.load_tokenizer(DataConfig(tokenizer=tokenizer.name))
    assert (by_file.bos, by_file.eos, by_file.vocab_size) == (tokenizer.bos, tokenizer.eos, 300)
    text = "The fox <|user|> jumps é\n"
    np.testing.assert_array_equal(tokenizer.encode(text), expected_ids(tokenizer_dir, text))
    assert ids_of(tokenizer_dir, "<|user|>") in tokenizer.encode(text)  # a special in the text
    np.testing.assert_array_equal(tokenizer.with_specials(np.array([7, 8])),
                                  [tokenizer.bos, 7, 8, tokenizer.eos])
    # The config's fields over tokenizer_config.json's; a tokenizer without BOS (Qwen's).
    chosen = pf_tokenizer.load_tokenizer(dataclasses.replace(
        data, bos_token="<|user|>", eos_token="<|assistant|>"))
    assert (chosen.bos, chosen.eos) == (ids_of(tokenizer_dir, "<|user|>"),
                                        ids_of(tokenizer_dir, "<|assistant|>"))
    train_tokenizer(tmp_path / "no_bos", config={"bos_token": None, "eos_token": "</s>"})
    no_bos = pf_tokenizer.load_tokenizer(DataConfig(tokenizer=str(tmp_path / "no_bos")))
    assert no_bos.bos is None
    np.testing.assert_array_equal(no_bos.with_specials(np.array([7])), [7, no_bos.eos])
    # Bytes.
    byte_level = pf_tokenizer.load_tokenizer(DataConfig(tokenizer="bytes"))
    assert byte_level is pf_tokenizer.load_tokenizer(DataConfig()) is pf_tokenizer.BYTE_TOKENIZER
    np.testing.assert_array_equal(byte_level.with_specials(byte_level.encode("aé")),
                                  [256, 97, 0xC3, 0xA9, 257])


def test_tokenizer_errors_name_the_field(tmp_path, tokenizer_dir):
    def fails(match, **fields):
        with pytest.raises(ConfigError, match=match):
            pf_tokenizer.load_tokenizer(DataConfig(**fields))

    fails(r"^data\.tokenizer: no such file or directory '.*nothing'",
          tokenizer=str(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    fails(r"^data\.tokenizer: no tokenizer\.json in '.*empty' \(set data\.tokenizer to a "
          r"tokenizer\.json, a directory holding one, or bytes\)",
          tokenizer=str(tmp_path / "empty"))
    (tmp_path / "broken.json").write_text('{"version": "1.0", "model": 3}')
    fails(r"^data\.tokenizer: '.*broken\.json' is not a tokenizer\.json that tokenizers reads",
          tokenizer=str(tmp_path / "broken.json"))
    fails(r"^data\.bos_token: '<nope>' is not a token of", tokenizer=str(tokenizer_dir),
          bos_token="<nope>")
    train_tokenizer(tmp_path / "bad_config", config={"eos_token": "<missing>"})
    fails(r"^data\.eos_token: the eos_token of tokenizer_config\.json beside .*: '<missing>' is "
          r"not a token", tokenizer=str(tmp_path / "bad_config"))
    train_tokenizer(tmp_path / "no_eos", config={"bos_token": "<s>"})
    fails(r"^data\.eos_token: .* names no EOS", tokenizer=str(tmp_path / "no_eos"))
    assert pf_tokenizer.load_tokenizer(DataConfig(tokenizer=str(tmp_path / "no_eos"),
                                                  eos_token="</s>")).eos == 2
    fails(r"^data\.eos_token: names a token of data\.tokenizer; the byte-level tokens have "
          r"their own", eos_token="</s>")


# ----------------------------------------------------------------------------------------------
# Documents and chat examples, packed.


@pytest.mark.parametrize("seq_len, max_segments", [(16, 3), (48, 8)])
def test_jsonl_documents_are_tokenized_and_packed(tmp_path, rng, tokenizer_dir, seq_len,
                                                  max_segments):
    """Documents through the tokenizer, over two epochs: each is ``[BOS] + tokenizers' ids +
    [EOS]``, every epoch holds each once, and the batches equal the plain reference packer's
    on them in the order the batches hold them (every token, in order, across sequences)."""
    texts = [random_text(rng, int(words)) for words in [*rng.integers(1, 4, 5),
                                                       *rng.integers(10, 40, 5)]]
    write_jsonl(tmp_path / "docs.jsonl", [{"text": text, "id": i} for i, text in
                                          enumerate(texts)])
    data = DataConfig(source="jsonl", path=str(tmp_path / "docs.jsonl"), text_field="text",
                      tokenizer=str(tokenizer_dir), seq_len=seq_len, batch_size=2,
                      max_segments=max_segments, seed=int(rng.integers(1000)))
    bos, eos = ids_of(tokenizer_dir, "<s>"), ids_of(tokenizer_dir, "</s>")
    documents = [np.array([bos, *expected_ids(tokenizer_dir, text), eos]) for text in texts]
    tokens = 2 * sum(len(document) for document in documents) + seq_len
    steps = (2 * len(texts) + tokens // seq_len + 2) // data.batch_size + 2
    got = packed(take(pf_data.make_batches(data, vocab_size=300), steps))
    order = order_of(got, documents, bos)
    n = len(texts)
    assert len(order) > 2 * n and sorted(order[:n]) == sorted(order[n:2 * n]) == list(range(n))
    expected = reference_pack([documents[i] for i in order + [0]], seq_len, max_segments,
                              steps * data.batch_size, pad_token=eos)
    for key in KEYS:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    assert (got["tokens"][:, 0] != bos).any()  # some documents continue in the next row


def test_corpus_through_a_tokenizer(tmp_path, rng, tokenizer_dir):
    """The corpus source takes a tokenizer too: its documents' ids are tokenizers' own."""
    texts = [random_text(rng, 6) for _ in range(5)]
    (tmp_path / "corpus.txt").write_text("\n\n".join(texts) + "\n")
    data = DataConfig(corpus_path=str(tmp_path / "corpus.txt"), tokenizer=str(tokenizer_dir),
                      seq_len=64, batch_size=2, max_segments=16)
    bos, eos = ids_of(tokenizer_dir, "<s>"), ids_of(tokenizer_dir, "</s>")
    documents = [np.array([bos, *expected_ids(tokenizer_dir, text), eos]) for text in texts]
    got = packed(take(pf_data.make_batches(data, vocab_size=300), 2))
    assert sorted(order_of(got, documents, bos)[:5]) == list(range(5))
    info = pf_data.describe(data)
    assert info["tokenizer"] == str(tokenizer_dir / "tokenizer.json") and "tokens" not in info


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_sft_targets_are_the_response_and_its_eos(tmp_path, rng, tokenizer_dir, tokenizer):
    """Chat examples, short sequences so that examples split across rows (prompts too):
    exactly the response tokens and the EOS carry targets, as the reference packer with each
    example's mask says (a piece continued in the next row keeps its mask); the prompt and BOS
    never do."""
    examples = [{"prompt": f"<|user|>{random_text(rng, int(rng.integers(1, 12)))}<|assistant|>",
                 "response": random_text(rng, int(rng.integers(0, 10)))} for _ in range(12)]
    examples[0]["response"] = ""  # only the EOS is predicted
    write_jsonl(tmp_path / "chat.jsonl", examples)
    data = DataConfig(source="jsonl", path=str(tmp_path / "chat.jsonl"), prompt_field="prompt",
                      response_field="response", seq_len=24, batch_size=2, max_segments=4,
                      tokenizer=None if tokenizer == "bytes" else str(tokenizer_dir),
                      seed=int(rng.integers(1000)))
    if tokenizer == "bytes":
        bos, eos = pf_data.BOS, pf_data.EOS
        def encode(text):
            return list(text.encode())
    else:
        bos, eos = ids_of(tokenizer_dir, "<s>"), ids_of(tokenizer_dir, "</s>")
        def encode(text):
            return expected_ids(tokenizer_dir, text)
    documents, masks = [], []
    for example in examples:
        prompt, response = encode(example["prompt"]), encode(example["response"])
        documents.append(np.array([bos, *prompt, *response, eos]))
        masks.append(np.array([0] * (1 + len(prompt)) + [1] * (len(response) + 1)))
    tokens = 2 * sum(len(document) for document in documents)
    steps = (2 * len(examples) + tokens // data.seq_len + 2) // data.batch_size + 2
    got = packed(take(pf_data.make_batches(data, vocab_size=300), steps))
    order = order_of(got, documents, bos)
    assert len(order) > len(examples)
    expected = reference_pack([documents[i] for i in order + [0]], data.seq_len,
                              data.max_segments, steps * data.batch_size, pad_token=eos,
                              masks=[masks[i] for i in order + [0]])
    for key in KEYS:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    # Stated directly: a target is the next token, in the same piece, of the response or EOS.
    flags = np.concatenate([masks[i] for i in order])
    stream = got["segment_ids"] > 0
    predicted = np.zeros_like(stream)
    predicted[stream] = flags[:stream.sum()]  # each token's flag, where the rows hold it
    has_target = got["targets"] != IGNORE
    assert has_target.any() and not has_target[:, -1].any()
    assert predicted[:, 1:][has_target[:, :-1]].all()
    inside = (got["segment_ids"][:, 1:] == got["segment_ids"][:, :-1]) & stream[:, 1:]
    assert (has_target[:, :-1] == (inside & predicted[:, 1:])).all()
    assert not (has_target[:, :-1] & (got["tokens"][:, 1:] == bos)).any()
    # Some example is cut inside its prompt and some inside its response.
    opens = got["tokens"][:, 0] != bos
    assert (opens & ~predicted[:, 0]).any() and (opens & predicted[:, 0]).any()


def test_byte_level_jsonl(tmp_path):
    """With bytes (the tokenizer null), a JSONL document is its UTF-8 bytes between 256 and
    257, as the corpus's are."""
    write_jsonl(tmp_path / "docs.jsonl", [{"text": "héllo"}], blank_lines=False)
    data = DataConfig(source="jsonl", path=str(tmp_path / "docs.jsonl"), text_field="text",
                      seq_len=10, batch_size=1)
    batch = next(pf_data.make_batches(data, vocab_size=260))
    np.testing.assert_array_equal(batch["tokens"][0, :8], [256, *"héllo".encode(), 257])
    np.testing.assert_array_equal(batch["segment_ids"][0], [1] * 8 + [2] * 2)  # the next epoch
    info = pf_data.describe(data)
    assert (info["source"], info["documents"], info["tokenizer"]) == ("jsonl", 1, "bytes")
    assert info["longest_document"] == len(json.dumps({"text": "héllo"}))


# ----------------------------------------------------------------------------------------------
# Resume and processes.


@pytest.mark.parametrize("kind", ["documents", "chat"])
@pytest.mark.parametrize("process_count", [1, 2])
def test_exact_resume_from_json_state(tmp_path, rng, tokenizer_dir, kind, process_count):
    """At every step of a few epochs: the state through JSON restored into a fresh iterator
    gives the same next batches (tests/test_data.py's corpus test, for JSONL)."""
    records = [{"text": random_text(rng, int(words)), "prompt": random_text(rng, 2),
                "response": random_text(rng, int(words))} for words in [1, 2, 9, 1, 14, 3, 1]]
    write_jsonl(tmp_path / "data.jsonl", records)
    fields = ({"text_field": "text"} if kind == "documents" else
              {"prompt_field": "prompt", "response_field": "response"})
    data = DataConfig(source="jsonl", path=str(tmp_path / "data.jsonl"),
                      tokenizer=str(tokenizer_dir), seq_len=12, batch_size=2, max_segments=2,
                      seed=int(rng.integers(1000)), **fields)
    states = assert_resumes_exactly(data, vocab_size=300, process_count=process_count,
                                    process_index=int(rng.integers(process_count)))
    assert 1 <= len(closed_states(states)) < len(states)  # both kinds of state


def test_processes_split_the_global_batch(tmp_path, rng, tokenizer_dir):
    write_jsonl(tmp_path / "chat.jsonl", [{"p": random_text(rng, 3), "r": random_text(rng, 5)}
                                          for _ in range(9)])
    data = DataConfig(source="jsonl", path=str(tmp_path / "chat.jsonl"), prompt_field="p",
                      response_field="r", tokenizer=str(tokenizer_dir), seq_len=16,
                      batch_size=4, max_segments=3)
    whole = take(pf_data.make_batches(data, vocab_size=300), 4)
    parts = [take(pf_data.make_batches(data, vocab_size=300, process_index=p, process_count=2),
                  4) for p in range(2)]
    assert_batches_equal([{key: np.concatenate([part[step][key] for part in parts])
                           for key in KEYS} for step in range(4)], whole)


# ----------------------------------------------------------------------------------------------
# Host memory.


@pytest.mark.parametrize("kind, tokenizer, seq_len, batch_size, max_segments", [
    ("documents", "bytes", 4096, 8, 32),
    ("chat", "bytes", 4096, 8, 32),
    ("chat", "bpe", 4096, 8, 32),
    ("chat", "bpe", 256, 32, 64),
])
def test_host_memory_bound(tmp_path, rng, tokenizer_dir, kind, tokenizer, seq_len, batch_size,
                           max_segments):
    """pipeline_host_terms' python part against tracemalloc's peak while a batch is made (the
    tokenizer's allocations outside Python are held by the next test). Short examples and
    a few of 20,000 words, so that long ones are tokenized within the measured batches and the
    segment cap binds. Measured peak / bound: bytes 0.43 (documents), 0.47 (chat); the BPE
    0.10 at 4096 x 8 and 0.03 at 256 x 32: L, the longest line's bytes, bounds its tokens, and
    a BPE token here is about 3 bytes (the bound must hold for a text of one token a byte)."""
    lengths = [2] * 100 + [20_000] * 3
    if kind == "documents":
        records = [{"text": random_text(rng, words)} for words in lengths]
        fields = {"text_field": "text"}
    else:
        records = [{"prompt": random_text(rng, words), "response": random_text(rng, 3)}
                   for words in lengths]
        fields = {"prompt_field": "prompt", "response_field": "response"}
    write_jsonl(tmp_path / "data.jsonl", [records[i] for i in rng.permutation(len(records))])
    data = DataConfig(source="jsonl", path=str(tmp_path / "data.jsonl"), seq_len=seq_len,
                      batch_size=batch_size, max_segments=max_segments,
                      tokenizer=None if tokenizer == "bytes" else str(tokenizer_dir), **fields)
    bound = pf_data.pipeline_host_terms(data)["python"]
    iterator = pf_data.make_batches(data, vocab_size=300)
    peak = max(measured_peak(iterator) for _ in range(4))
    print(f"peak {peak} bound {bound} ratio {peak / bound:.2f}")
    assert peak <= bound
    assert peak >= 4 * 4 * seq_len * batch_size  # the outputs themselves


NATIVE_PROBE = textwrap.dedent("""
    import json, resource, sys
    from peakflat_jax.config import DataConfig
    from peakflat_jax.train import data as pf_data

    def resident():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    data = DataConfig(**json.loads(sys.argv[1]))
    before = resident()
    iterator = pf_data.make_batches(data, vocab_size=300)
    for _ in range(3):
        next(iterator)
    print(json.dumps({"grown": resident() - before, "bound": pf_data.pipeline_host_bytes(data),
                      "index": 16 * pf_data.describe(data)["documents"]}))
""")


def test_host_memory_bound_holds_the_tokenizers_own(tmp_path, rng, tokenizer_dir):
    """In a fresh process, its peak resident memory (ru_maxrss: Python's allocations and the
    Rust side's alike) grows by less than pipeline_host_bytes (+ the index) over loading the
    tokenizer and making three batches of which one holds a document of 1 MB, most of whose
    cost is the tokenizer's encoding outside Python (tokenizer.ENCODE_BYTES). Measured growth
    / bound: 0.50 (186 MB for a document of 1.03 MB)."""
    text = random_text(rng, 170_000)
    assert len(text.encode()) > 1_000_000
    write_jsonl(tmp_path / "data.jsonl", [{"text": text}], blank_lines=False)
    fields = dict(source="jsonl", path=str(tmp_path / "data.jsonl"), text_field="text",
                  tokenizer=str(tokenizer_dir), seq_len=1024, batch_size=8)
    completed = subprocess.run([sys.executable, "-c", NATIVE_PROBE, json.dumps(fields)],
                               cwd=pathlib.Path(__file__).resolve().parents[1],
                               capture_output=True, text=True, timeout=120, check=True)
    measured = json.loads(completed.stdout.splitlines()[-1])
    print(measured, f"ratio {measured['grown'] / measured['bound']:.2f}")
    assert measured["grown"] <= measured["bound"] + measured["index"]


# ----------------------------------------------------------------------------------------------
# Errors, and the pretrained checkpoint's tokenizer.


def test_jsonl_errors_name_the_field_and_line(tmp_path, tokenizer_dir):
    def fails(match, lines=None, vocab_size=300, **fields):
        if lines is not None:
            (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
        fields = {"source": "jsonl", "path": str(tmp_path / "data.jsonl"), "text_field": "text",
                  **fields}
        with pytest.raises(ConfigError, match=match):
            pf_data.make_batches(DataConfig(**fields), vocab_size=vocab_size)

    good = json.dumps({"text": "a", "prompt": "b", "response": "c"})
    fails(r"^data\.path: no such file '.*nothing\.jsonl'", path=str(tmp_path / "nothing.jsonl"))
    fails(r"^data\.path: the jsonl source needs a JSONL file", path=None)
    fails(r"^data\.text_field: .* has no field 'text' \(its fields: \['body'\]\)".replace(
        ".*", "line 3 of '.*data\\.jsonl'"), [good, "", json.dumps({"body": "x"})])
    fails(r"^data\.response_field: line 2 of .* has no field 'answer'",
          [json.dumps({"prompt": "b", "answer": "c"}), good],
          text_field=None, prompt_field="prompt", response_field="answer")
    fails(r"^data\.prompt_field: line 1 of .*: 'prompt' holds a list, expected a string",
          [json.dumps({"prompt": [{"role": "user"}], "response": "x"})], text_field=None,
          prompt_field="prompt", response_field="response")
    fails(r"^data\.path: line 2 of .* is not JSON", [good, "{'text': 1}"])
    fails(r"^data\.path: line 1 of .* holds a list, expected a JSON object", ["[1, 2]"])
    (tmp_path / "data.jsonl").write_text("")
    fails(r"^data\.path: .* holds no example \(it is empty\)")
    fails(r"^data\.path: .* holds no example \(only blank lines\)", ["", "  ", "\r"])
    fails(r"^data\.text_field: set either it \(documents\) or data\.prompt_field", [good],
          prompt_field="prompt", response_field="response")
    fails(r"^data\.response_field: chat examples need both", [good], text_field=None,
          prompt_field="prompt")
    fails(r"^data\.text_field: the jsonl source needs the field", [good], text_field=None)
    fails(r"^data\.tokenizer: '.*tokenizer\.json' has 300 tokens \(ids up to 299\), more than "
          r"model\.vocab_size = 260", [good], tokenizer=str(tokenizer_dir), vocab_size=260)
    fails(r"^model\.vocab_size: the jsonl source needs 260 <= vocab_size", [good],
          vocab_size=259)
    with pytest.raises(ConfigError, match=r"^model\.vocab_size: byte-level text needs at least "
                                          r"260"):
        load_config("tiny", ["data.source=jsonl", "data.path=x.jsonl", "data.text_field=text",
                             "model.vocab_size=256"])
    with pytest.raises(ConfigError, match=r"^data\.path: the jsonl source needs"):
        load_config("tiny", ["data.source=jsonl"])  # refused as the config is read


MIXTRAL = {"model_type": "mixtral", "vocab_size": 320, "hidden_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
           "intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2}


def test_pretrained_checkpoint_tokenizes_with_its_own(tmp_path, tokenizer_dir):
    """With model.from_pretrained, a null data.tokenizer is the checkpoint's directory (its
    tokenizer.json, or an error saying what to set); ``bytes`` keeps byte-level tokens; a
    synthetic source is left alone. (Only the configs and the batches: no weights are read.)"""
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(MIXTRAL))
    write_jsonl(tmp_path / "chat.jsonl", [{"p": "the fox", "r": "jumps"}])
    (tmp_path / "run.yaml").write_text(
        f"model:\n  from_pretrained: {checkpoint}\nmesh:\n  data: 2\n  seq: 4\ndata:\n  source: "
        f"jsonl\n  path: {tmp_path / 'chat.jsonl'}\n  prompt_field: p\n  response_field: r\n")
    config = load_config(tmp_path / "run.yaml")
    assert config.data.tokenizer == str(checkpoint) and config.model.vocab_size == 320
    with pytest.raises(ConfigError, match=r"^data\.tokenizer: no tokenizer\.json in "):
        pf_data.make_batches(config.data, vocab_size=config.model.vocab_size)
    train_tokenizer(checkpoint)
    batch = next(pf_data.make_batches(config.data, vocab_size=config.model.vocab_size))
    first = [ids_of(checkpoint, "<s>"), *expected_ids(checkpoint, "the fox")]
    np.testing.assert_array_equal(batch["tokens"][0, :len(first)], first)
    assert load_config(tmp_path / "run.yaml", ["data.tokenizer=bytes"]).data.tokenizer == "bytes"
    synthetic = load_config(tmp_path / "run.yaml", ["data.source=synthetic"])
    assert synthetic.data.tokenizer is None


def test_planner_counts_the_pipeline_of_a_jsonl_source(tmp_path, tokenizer_dir, rng):
    """The planner's host term for the pipeline of a JSONL source through a tokenizer is
    pipeline_host_bytes with the file's longest line and the tokenizer's tables, per device;
    its attention pairs are those of the packed batches."""
    from peakflat_jax.plan import make_plan

    write_jsonl(tmp_path / "chat.jsonl", [{"p": random_text(rng, int(words)),
                                           "r": random_text(rng, 9)} for words in
                                          rng.integers(5, 200, 20)])
    config = load_config("tiny", [
        "data.source=jsonl", f"data.path={tmp_path / 'chat.jsonl'}", "data.prompt_field=p",
        "data.response_field=r", f"data.tokenizer={tokenizer_dir}", "model.vocab_size=320",
        "data.seq_len=64"])
    plan = make_plan(config, 8, platform="cpu", baseline=False, search_context=False,
                     data_stats=pf_data.data_stats(config.data))
    term = next(term for term in plan.terms if term.name == "host.data_pipeline")
    longest = pf_data.describe(config.data)["longest_document"]
    assert longest == max(len(line) for line in (tmp_path / "chat.jsonl").read_bytes().split(
        b"\n"))
    expected = pf_data.pipeline_host_bytes(config.data, longest_document=longest)
    assert expected > pf_tokenizer.TABLE_BYTES * (
        tokenizer_dir / "tokenizer.json").stat().st_size
    assert term.bytes == expected // 8
    pairs = pf_data.causal_pairs_per_sequence(config.data)
    assert 0 < pairs < 64 * 65 / 2  # several examples a sequence, or a split one
