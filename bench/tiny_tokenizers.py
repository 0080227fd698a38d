"""Tokenizers for tiny random models, built offline (no hub): random weights need no real vocabulary."""

import json
import os
import string


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


def t5_tokenizer(model_max_length=None):
    """A T5 tokenizer over a unigram vocabulary of single characters and a few words (ids 0 <pad>, 1 </s>, 2 <unk>,
    as T5's own)."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(c, -3.0) for c in string.ascii_letters + string.digits + string.punctuation]
    pieces += [("▁" + w, -1.0) for w in ("a", "photo", "of", "sks", "dog", "in", "the", "bucket")]
    kwargs = {"model_max_length": model_max_length} if model_max_length else {}
    return T5TokenizerFast(vocab=pieces, extra_ids=0, **kwargs)
