"""Writes a tiny Llama with random weights, in Hugging Face format, for vLLM to serve.

The same shape as tests/real_engines/tiny_llama.py writes for llama.cpp (8 layers, hidden 512,
8 heads, FFN 1376, 32000-token SentencePiece vocabulary), so prompts are real text cut into real
tokens and the two engines do comparable work. The tokenizer is the 32000-token SentencePiece
model that PyPI's mistral_common ships (mistral_common/data/tokenizer.model.v1, a Llama-style
vocabulary), converted to tokenizer.json by transformers: nothing comes from a hub.
The weights are seeded, so the same directory comes out on every machine.

    python tiny_hf_llama.py OUT_DIR
"""

import json
import os
import shutil
import sys
import tempfile

import mistral_common
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

LAYERS, HIDDEN, HEADS, FFN, CONTEXT = 8, 512, 8, 1376, 8192

# A plain ChatML-style template on ordinary text (the vocabulary has no chat tokens).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = message['content'] | map(attribute='text') | join('') %}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ text }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    spm = os.path.join(os.path.dirname(mistral_common.__file__), "data", "tokenizer.model.v1")
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(spm, os.path.join(tmp, "tokenizer.model"))
        with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
            json.dump(
                {
                    "tokenizer_class": "LlamaTokenizer",
                    "bos_token": "<s>",
                    "eos_token": "</s>",
                    "unk_token": "<unk>",
                    "add_bos_token": True,
                    "add_eos_token": False,
                    "legacy": False,
                },
                f,
            )
        tok = AutoTokenizer.from_pretrained(tmp)
    tok.chat_template = CHAT_TEMPLATE
    tok.model_max_length = CONTEXT
    tok.save_pretrained(out)

    torch.manual_seed(11434)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=CONTEXT,
        rms_norm_eps=1e-5,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
        initializer_range=0.02,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    # Random weights rarely pick EOS, so generations run to max_tokens; no generation_config
    # sampling defaults either way.
    print(out, len(tok), sum(p.numel() for p in model.parameters()), file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1])
