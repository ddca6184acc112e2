"""Build a random-weight Llama and a BPE tokenizer with a chat template.

Run by the vLLM venv's python (it needs torch, transformers and tokenizers):

    python build_tiny_model.py OUT_DIR [--preset tiny|prefill]

Writes a Hugging Face model directory vLLM can serve. Deterministic for a given
version of this file, preset and transformers/tokenizers, so the test fixture caches
the result under a hash of this file's content and the preset. head_dim is at least
32: vLLM's CPU attention kernels reject 16.

Presets (``MODEL_PRESETS``; both share the tokenizer):
- ``tiny`` (default): 2 layers of width 64. Prefill costs about as much as the HTTP
  round trip, so re-prefill is nearly free: right for plugin tests, useless for
  showing what a prefix-cache hit saves.
- ``prefill``: 8 layers of width 512 (GQA 8/2 heads, head_dim 64), about 44 MB, sized
  so that on a 2-core CPU a cold prefill of a 1,000-2,000-token agent context costs
  at least a short turn's decode, as on a real model serving long contexts. The
  real-vLLM `vllm-prefill`
  benchmark regime runs on it.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]


def training_corpus(seed: int = 0, lines: int = 4000) -> list[str]:
    """Pseudo-English lines from a fixed syllable inventory (no download needed)."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ren", "to", "sa", "vel", "dor", "in", "ex", "qu", "ab", "ze", "pol", "rit"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(600)]
    words += ["the", "tool", "result", "file", "error", "line", "def", "return", "import", "class"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 25))) for _ in range(lines)]


def build_tokenizer(out_dir: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="</s>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 4096
    fast.save_pretrained(out_dir)
    return len(fast)


# LlamaConfig sizes per preset (see the module docstring for why these two).
MODEL_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
    ),
    "prefill": dict(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
    ),
}


# Weights are saved in the dtype vLLM's CPU backend runs them in anyway (it downcasts
# float32 checkpoints to bfloat16); the tiny model keeps its original float32 file.
PRESET_DTYPES = {"tiny": "float32", "prefill": "bfloat16"}


def build_model(out_dir: Path, vocab_size: int, preset: str = "tiny") -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        **MODEL_PRESETS[preset],
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).to(getattr(torch, PRESET_DTYPES[preset]))
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(out_dir)


def main() -> int:
    parser = argparse.ArgumentParser(description="build a random-weight Llama that vLLM can serve")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--preset", choices=sorted(MODEL_PRESETS), default="tiny")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size = build_tokenizer(args.out_dir)
    build_model(args.out_dir, vocab_size, args.preset)
    return 0


if __name__ == "__main__":
    sys.exit(main())
