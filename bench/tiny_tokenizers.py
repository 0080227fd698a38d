"""Tokenizers for tiny random models, built offline (no hub): random weights need no real vocabulary."""

import json
import os


def clip_tokenizer(folder):
    """A CLIP tokenizer of every byte, alone and word-final, without merges; its source files go into ``folder``."""
    from transformers import CLIPTokenizer

    try:
        from transformers.models.clip.tokenization_clip import bytes_to_unicode
    except ImportError:  # transformers 5 keeps it with the slow-tokenizer converter
        from transformers.convert_slow_tokenizer import bytes_to_unicode

    os.makedirs(folder, exist_ok=True)
    chars = list(bytes_to_unicode().values())
    vocab = {t: i for i, t in enumerate(chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"])}
    with open(os.path.join(folder, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(folder, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n")
    return CLIPTokenizer(os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt"),
                         pad_token="<|endoftext|>", model_max_length=77)
