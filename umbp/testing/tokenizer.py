"""A tokenizer made locally (no hub) for the random-weight test models, so that
``vllm serve`` can start on them and answer the OpenAI API with text."""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ("<unk>", "<s>", "</s>")


def write_word_tokenizer(directory: Path, vocab_size: int) -> Path:
    """A word-level ``tokenizers`` tokenizer: ids 0-2 are ``<unk> <s> </s>``, id
    ``i`` >= 3 is the word ``w<i>``; words are split on whitespace. Writes
    ``tokenizer.json`` and ``tokenizer_config.json`` next to a model's files."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate(SPECIALS)}
    vocab.update({f"w{index}": index for index in range(len(SPECIALS), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(list(SPECIALS))
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>",
        "model_max_length": 1 << 20, "add_bos_token": False,
    }))
    return directory
