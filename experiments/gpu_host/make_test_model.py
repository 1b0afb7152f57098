#!/usr/bin/env python3
"""Build a random-weight Llama with a byte-level tokenizer, fully offline.

Two presets serve the experiments:
- ``tiny``  (equivalence): 8 layers, hidden 1024, 8 KV heads x head_dim 128, bf16:
  32 KiB of KV per token. Its init (std 0.2) is deliberately large, so greedy output
  depends strongly on the KV cache and a corrupted transfer changes the text.
- ``kvbig`` (transfer benchmark): 32 layers, 16 KV heads x head_dim 128 but hidden 256,
  bf16: 256 KiB of KV per token (1 GiB at 4096 tokens) with only ~85 M parameters,
  because ``head_dim`` is set apart from hidden/heads (LlamaConfig and vLLM both read it).

The tokenizer has one token per byte (256 byte symbols + 4 specials, no merges) and
prepends BOS, so an ASCII prompt of N-1 characters is exactly N tokens; the vocabulary
is padded to the model's so every id the model can emit decodes.

Needs only torch, transformers and tokenizers (all on the GPU host); downloads nothing.

usage: make_test_model.py OUT_DIR --preset tiny|kvbig [overrides: --layers ... --head-dim ...]
"""

from __future__ import annotations

import argparse
import json
import os

PRESETS = {
    "tiny": dict(layers=8, hidden=1024, heads=8, kv_heads=8, head_dim=128, intermediate=2816,
                 max_pos=4096, init_range=0.2),
    "kvbig": dict(layers=32, hidden=256, heads=16, kv_heads=16, head_dim=128, intermediate=512,
                  max_pos=8192, init_range=0.02),
}
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    byte_syms = sorted(pre_tokenizers.ByteLevel.alphabet())  # 256 stand-ins for bytes
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for sym in byte_syms:
        vocab[sym] = len(vocab)
    assert len(vocab) == 260 <= vocab_size
    for i in range(len(vocab), vocab_size):  # ids the model may emit must decode
        vocab[f"<|tok_{i}|>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>",
                                   model_max_length=1 << 30)
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}")
    return fast


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: str) -> int:
    return layers * 2 * kv_heads * head_dim * DTYPE_BYTES[dtype]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "max_pos"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    ap.add_argument("--init-range", type=float, default=None)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    geo = dict(PRESETS[a.preset])
    for key in geo:
        if getattr(a, key) is not None:
            geo[key] = getattr(a, key)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(a.seed)
    cfg = LlamaConfig(
        vocab_size=a.vocab, hidden_size=geo["hidden"], intermediate_size=geo["intermediate"],
        num_hidden_layers=geo["layers"], num_attention_heads=geo["heads"],
        num_key_value_heads=geo["kv_heads"], head_dim=geo["head_dim"],
        max_position_embeddings=geo["max_pos"], rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=3,
        initializer_range=geo["init_range"])
    model = LlamaForCausalLM(cfg).to(getattr(torch, a.dtype)).eval()
    os.makedirs(a.out, exist_ok=True)
    model.save_pretrained(a.out, safe_serialization=True)
    build_tokenizer(a.vocab).save_pretrained(a.out)
    with open(os.path.join(a.out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3, "do_sample": False}, f)
    kv = kv_bytes_per_token(geo["layers"], geo["kv_heads"], geo["head_dim"], a.dtype)
    info = {"preset": a.preset, **geo, "dtype": a.dtype, "vocab": a.vocab,
            "kv_bytes_per_token": kv,
            "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)}
    with open(os.path.join(a.out, "kvpd_model_info.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(f"wrote {a.out}: {info['params_m']}M params, {kv // 1024} KiB of KV per token "
          f"({kv * geo['max_pos'] / 2**30:.2f} GiB at {geo['max_pos']} tokens)")


if __name__ == "__main__":
    main()
