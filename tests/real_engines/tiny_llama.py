"""Writes a tiny Llama with random weights, in GGUF, for llama-server to serve in tests.

Its vocabulary is copied from a tokenizer-only GGUF (llama.cpp ships them), so that prompts
are real text cut into real tokens: prefill, the KV-cache reuse and streaming are the
engine's own. The weights are seeded, so the same file comes out on every machine.

    python tiny_llama.py VOCAB.gguf OUT.gguf
"""

import sys

import gguf
import numpy as np

LAYERS, HIDDEN, HEADS, FFN, CONTEXT = 8, 512, 8, 1376, 8192


def main(vocab_path: str, out_path: str) -> None:
    vocab = gguf.GGUFReader(vocab_path)
    writer = gguf.GGUFWriter(out_path, "llama")
    writer.add_name("prefixlb-tiny-llama")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    n_vocab = 0
    for name, field in vocab.fields.items():
        if not name.startswith("tokenizer."):
            continue
        value = field.contents()
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub)
        if name == "tokenizer.ggml.tokens":
            n_vocab = len(value)

    rng = np.random.default_rng(11434)

    def random(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    ones = np.ones(HIDDEN, dtype=np.float32)
    writer.add_tensor("token_embd.weight", random(n_vocab, HIDDEN))
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        for part in ("q", "k", "v", "output"):
            writer.add_tensor(f"blk.{i}.attn_{part}.weight", random(HIDDEN, HIDDEN))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", random(FFN, HIDDEN))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", random(FFN, HIDDEN))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", random(HIDDEN, FFN))
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", random(n_vocab, HIDDEN))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
