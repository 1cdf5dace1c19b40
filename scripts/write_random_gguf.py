"""Writes a random-weight Llama-shaped GGUF file in F16, as llama.cpp's converter lays one out, with the
tokenizer and chat template of builtin:smollm2's file: a model of the size people deploy, for speed
(random weights are as real as trained ones for that), which `llama-quantize` then turns into the files
people download (`scripts/build_llama_server.sh` builds it).

    python scripts/write_random_gguf.py --out bench_out/random-1b-f16.gguf      # 1.07B parameters
    ~/.cache/coreserve/llama.cpp-0.3.36/build/bin/llama-quantize bench_out/random-1b-f16.gguf \\
        bench_out/random-1b-Q4_K_M.gguf Q4_K_M

The default shape: hidden 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192, SmolLM2's 49,152-token
vocabulary, tied embeddings. Weights ~ N(0, 0.02), norms 1.

`--arch qwen3moe` writes a Qwen3-MoE instead (q/k norms, a router and 3-D expert tensors per layer), in
Qwen3-30B-A3B's layer shape by default (hidden 2048, 32 heads of 128, 4 KV heads, 128 experts of FFN
768, 8 a token) with fewer layers (`--layers`):

    python scripts/write_random_gguf.py --arch qwen3moe --layers 6 --out bench_out/random-moe-f16.gguf
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from coreserve.protocol.builtin_model import builtin_model_path  # noqa: E402

_COPIED = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template")
_COPIED_IDS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arch", choices=["llama", "qwen3moe"], default="llama")
    parser.add_argument("--head-dim", type=int, default=0, help="0: hidden / heads (qwen3moe: 128)")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--experts-used", type=int, default=8)
    parser.add_argument("--expert-ffn", type=int, default=768)
    args = parser.parse_args()
    if args.arch == "qwen3moe" and args.kv_heads == 8 and "--kv-heads" not in sys.argv:
        args.kv_heads = 4  # Qwen3-30B-A3B's
    return args


def field_value(reader, name: str):
    field = reader.fields[name]
    part = field.parts[field.data[0]]
    return bytes(part).decode() if field.types[0].name == "STRING" else part[0].item()


def add_tokenizer(writer, reader) -> int:
    """SmolLM2's tokenizer and chat template, as its file holds them; returns the vocabulary size."""
    fields = reader.fields
    tokens = [bytes(fields["tokenizer.ggml.tokens"].parts[i]).decode() for i in fields["tokenizer.ggml.tokens"].data]
    merges = [bytes(fields["tokenizer.ggml.merges"].parts[i]).decode() for i in fields["tokenizer.ggml.merges"].data]
    types = [int(fields["tokenizer.ggml.token_type"].parts[i][0]) for i in fields["tokenizer.ggml.token_type"].data]
    writer.add_tokenizer_model(field_value(reader, "tokenizer.ggml.model"))
    writer.add_tokenizer_pre(field_value(reader, "tokenizer.ggml.pre"))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(field_value(reader, "tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(field_value(reader, "tokenizer.ggml.eos_token_id"))
    writer.add_unk_token_id(field_value(reader, "tokenizer.ggml.unknown_token_id"))
    writer.add_pad_token_id(field_value(reader, "tokenizer.ggml.padding_token_id"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(field_value(reader, "tokenizer.chat_template"))
    return len(tokens)


def main() -> None:
    import gguf

    args = parse_args()
    reader = gguf.GGUFReader(builtin_model_path("smollm2"))
    is_moe = args.arch == "qwen3moe"
    writer = gguf.GGUFWriter(args.out, args.arch)
    writer.add_name("coreserve random " + ("Qwen3-MoE" if is_moe else "Llama"))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    head_dim = args.head_dim or (128 if is_moe else args.hidden // args.heads)
    writer.add_context_length(8192)
    writer.add_embedding_length(args.hidden)
    writer.add_block_count(args.layers)
    writer.add_feed_forward_length(args.ffn)
    writer.add_head_count(args.heads)
    writer.add_head_count_kv(args.kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(100000.0)
    writer.add_rope_dimension_count(head_dim)
    if is_moe:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_expert_count(args.experts)
        writer.add_expert_used_count(args.experts_used)
        writer.add_expert_feed_forward_length(args.expert_ffn)
    vocab = add_tokenizer(writer, reader)
    writer.add_vocab_size(vocab)
    rng = np.random.default_rng(args.seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    ones = np.ones(args.hidden, dtype=np.float32)
    writer.add_tensor("token_embd.weight", matrix(vocab, args.hidden))
    writer.add_tensor("output_norm.weight", ones)
    kv, q = args.kv_heads * head_dim, args.heads * head_dim
    for i in range(args.layers):
        for name, shape in (("attn_q", (q, args.hidden)), ("attn_k", (kv, args.hidden)),
                            ("attn_v", (kv, args.hidden)), ("attn_output", (args.hidden, q))):
            writer.add_tensor(f"blk.{i}.{name}.weight", matrix(*shape))
        if is_moe:
            writer.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
            writer.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))
            writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", matrix(args.experts, args.hidden).astype(np.float32))
            for name, shape in (("ffn_gate_exps", (args.expert_ffn, args.hidden)),
                                ("ffn_up_exps", (args.expert_ffn, args.hidden)),
                                ("ffn_down_exps", (args.hidden, args.expert_ffn))):
                stacked = np.stack([matrix(*shape) for _ in range(args.experts)])  # [experts, rows, columns]
                writer.add_tensor(f"blk.{i}.{name}.weight", stacked)
        else:
            for name, shape in (("ffn_gate", (args.ffn, args.hidden)), ("ffn_up", (args.ffn, args.hidden)),
                                ("ffn_down", (args.hidden, args.ffn))):
                writer.add_tensor(f"blk.{i}.{name}.weight", matrix(*shape))
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
