"""Build a tiny random Llama that vLLM can load, offline, to try kvshm's connector.

Run: python examples/tiny_llama.py [FOLDER]        (default folder: ./tiny-llama)

No hub, no network: the weights are random (fixed seed) and the tokenizer is a
word-level one whose words ``w0 .. w507`` are one token each, so a prompt's length in
tokens is its number of words. 2 layers, hidden 128, 4 attention heads, 2 KV heads
(head_dim 32, a size vLLM's CPU attention backend supports), vocab 512, float32. The
output is meaningless text; what it is for is seeing the CPU tier hit (README, "vLLM").

The one builder of this model: the vLLM tests' fixtures (tests/vllm/conftest.py) build
theirs with it too (``sliding_window`` gives the hybrid variant), so what a user tries
is what the tests run. It imports nothing from kvshm or the tests. Needs
``transformers`` and ``tokenizers``, which vLLM installs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any, Final

SPECIAL_TOKENS: Final = ("<unk>", "<s>", "</s>", "<pad>")
VOCAB_SIZE: Final = 512
NUM_WORDS: Final = VOCAB_SIZE - len(SPECIAL_TOKENS)
SEED: Final = 0


def prompt(num_tokens: int, start: int = 0) -> str:
    """A prompt of exactly ``num_tokens`` tokens: the words ``w{start} ..`` (wrapping)."""
    return " ".join(f"w{(start + i) % NUM_WORDS}" for i in range(num_tokens))


def build_tokenizer(folder: Path) -> None:
    """Write the word-level tokenizer (``w0`` .. ``w507`` and four special tokens)."""
    tokenizers = importlib.import_module("tokenizers")
    transformers = importlib.import_module("transformers")

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": len(SPECIAL_TOKENS) + i for i in range(NUM_WORDS)})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>")
    fast.save_pretrained(str(folder))


def build_model(folder: Path, sliding_window: int | None = None) -> Any:
    """Write the random Llama's config and weights (safetensors); returns the config.
    With ``sliding_window``, layer 0 attends over that many tokens only (vLLM's Llama
    reads ``layer_types``), so vLLM's hybrid allocator gives the model two KV cache
    groups: sliding-window and full attention."""
    import torch

    transformers = importlib.import_module("transformers")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False)
    if sliding_window is not None:
        config.layer_types = ["sliding_attention", "full_attention"]
        config.sliding_window = sliding_window
    torch.manual_seed(SEED)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        # A random init gives near-flat logits; scale them so greedy outputs and
        # logprobs are distinct and any KV corruption shows.
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(str(folder), safe_serialization=True)
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", default="tiny-llama",
                        help="where to write the model (created; default ./tiny-llama)")
    args = parser.parse_args(argv)
    folder = Path(args.folder).resolve()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        build_tokenizer(folder)
        build_model(folder)
    except ModuleNotFoundError as e:
        print(f"tiny_llama: {e.name} is missing; it comes with vLLM "
              "(bash tools/vllm_install.sh .venv/bin/python)", file=sys.stderr)
        return 1
    print(f"tiny Llama written to {folder}")
    print(f"try: python examples/vllm_quickstart.py {folder} "
          "(or examples/vllm_serve_quickstart.sh)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
