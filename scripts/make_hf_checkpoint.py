"""A random Hugging Face MoE checkpoint of a chosen size, with a tokenizer, for fine-tuning
benchmarks (issue 29's GPU run): nothing is downloaded.

    python scripts/make_hf_checkpoint.py OUT_DIR [--family qwen3_moe] [--layers 8] ...

Runs with torch and transformers (the GPU image's python3, or scripts/xcheck_torch_env.sh's):
a byte-level BPE trained by ``tokenizers`` on the shipped corpus (its vocabulary is the
model's), then ``AutoConfig.for_model`` -> ``AutoModelForCausalLM.from_config`` in bf16 (on the
GPU where there is one: a few billion parameters initialise in seconds there, minutes on a
host) -> ``save_pretrained``. Prints one JSON line: the directory, the parameter count, the
vocabulary and the seconds each part took."""

from __future__ import annotations

import argparse
import json
import pathlib
import time

CORPUS = pathlib.Path(__file__).resolve().parents[1] / "peakflat_jax/train/corpus"


def train_tokenizer(out: pathlib.Path, vocab_size: int) -> int:
    """A byte-level BPE of ``vocab_size`` tokens on the corpus, with <|endoftext|> as EOS."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(p) for p in sorted(CORPUS.glob("*.txt"))], trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    return tokenizer.get_vocab_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--family", default="qwen3_moe", choices=["qwen3_moe", "mixtral"])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--expert-ffn", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192, help="the BPE's vocabulary")
    parser.add_argument("--max-positions", type=int, default=131072)
    parser.add_argument("--config-only", action="store_true",
                        help="config.json and the tokenizer only (enough for `peakflat plan`)")
    args = parser.parse_args()

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    vocab = train_tokenizer(out, args.vocab)
    tokenized = time.perf_counter()
    fields = dict(vocab_size=vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                  head_dim=args.head_dim, max_position_embeddings=args.max_positions,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                  tie_word_embeddings=False, eos_token_id=0, bos_token_id=None)
    if args.family == "qwen3_moe":
        fields.update(moe_intermediate_size=args.expert_ffn, num_experts=args.experts,
                      num_experts_per_tok=args.top_k, norm_topk_prob=True, mlp_only_layers=[],
                      intermediate_size=4 * args.hidden)
    else:
        fields.update(intermediate_size=args.expert_ffn, num_local_experts=args.experts,
                      num_experts_per_tok=args.top_k)
    config = AutoConfig.for_model(args.family, **fields)
    if args.config_only:
        config.save_pretrained(out)
        print(json.dumps(dict(dir=str(out), family=args.family, vocab=vocab, config_only=True)))
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    made = time.perf_counter()
    model.save_pretrained(out)
    saved = time.perf_counter()
    print(json.dumps(dict(dir=str(out), family=args.family, device=device,
                          parameters=sum(p.numel() for p in model.parameters()), vocab=vocab,
                          seconds=dict(tokenizer=round(tokenized - start, 1),
                                       init=round(made - tokenized, 1),
                                       save=round(saved - made, 1)))))


if __name__ == "__main__":
    main()
