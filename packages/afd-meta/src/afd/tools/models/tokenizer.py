"""The local tokenizer of the tiny checkpoints: a byte-level BPE trained, deterministically,
on a small built-in corpus (English sentences, Q&A, code, numbers, JSON), with a plain
chat template. Every tiny and bench checkpoint of every architecture gets the same one.

``tokenizers`` and ``transformers`` are imported inside the functions that need them.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

__all__ = [
    "BOS",
    "CHAT_TEMPLATE",
    "END_OF_TEXT",
    "EOS",
    "PAD",
    "SPECIAL_TOKENS",
    "TOKENIZER_VOCAB_SIZE",
    "save_tokenizer",
    "tokenizer_json",
    "tokenizer_vocab_size",
]

#: Target size of the locally trained byte-level BPE vocabulary (the model's vocab_size
#: is the tokenizer's actual size, which is this whenever the corpus allows it).
TOKENIZER_VOCAB_SIZE = 1024
#: ``<|endoftext|>`` is in the vocabulary because some tokenizer classes transformers
#: picks from a model type (Qwen3.5's) add it when it is missing, which would make the
#: tokenizer one token larger than the model's vocabulary.
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|endoftext|>")
BOS, EOS, PAD, END_OF_TEXT = SPECIAL_TOKENS
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


_SUBJECTS = (
    "the cat",
    "a small robot",
    "my neighbour",
    "the old river",
    "every student",
    "the attention layer",
    "an expert network",
    "the tiny model",
    "our team",
    "the weather",
    "a quiet city",
    "the yellow train",
    "this program",
    "the compiler",
)
_VERBS = (
    "runs",
    "watches",
    "computes",
    "sends",
    "receives",
    "builds",
    "reads",
    "writes",
    "jumps over",
    "talks to",
    "waits for",
    "routes",
    "predicts",
    "remembers",
)
_OBJECTS = (
    "the moon",
    "a long message",
    "seven tokens",
    "the blue house",
    "an open door",
    "the next word",
    "many experts",
    "a warm cup of tea",
    "the hidden state",
    "the last train home",
    "a list of numbers",
    "the shared memory",
    "green apples",
)
_ENDINGS = (
    ".",
    " today.",
    " every morning.",
    " in the evening.",
    " again and again.",
    " without any doubt.",
    " before the rain.",
    " on the CPU.",
    " as fast as it can.",
)
_EXTRA = """
Once upon a time there was a little village near the mountains. The people there liked
stories, music and long walks. In the morning the baker opened the shop and sold fresh
bread; in the afternoon children played in the park; at night everyone looked at stars.
Question: What is the capital of France? Answer: The capital of France is Paris.
Question: How many legs does a spider have? Answer: A spider has eight legs.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
import torch; x = torch.zeros(4, 8); y = x.sum(dim=-1)
{"name": "afd", "version": "0.1.0", "layers": [0, 1, 2], "experts": 8}
1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 32 64 128 256 512 1024 2048 4096
Monday Tuesday Wednesday Thursday Friday Saturday Sunday
January February March April May June July August September October November December
red orange yellow green blue indigo violet black white grey brown pink purple
Hello, world! How are you? I am fine, thank you. Good morning. Good night.
Mixture of experts models route each token to a few experts; attention layers keep the
key value cache; the feed forward network holds most of the parameters.
"""


@lru_cache(maxsize=1)
def _corpus() -> tuple[str, ...]:
    lines = []
    for i, s in enumerate(_SUBJECTS):
        for j, v in enumerate(_VERBS):
            o = _OBJECTS[(i * 5 + j * 3) % len(_OBJECTS)]
            e = _ENDINGS[(i + 2 * j) % len(_ENDINGS)]
            lines.append(f"{s[0].upper()}{s[1:]} {v} {o}{e}")
    lines.extend(line for line in _EXTRA.strip().splitlines() if line)
    return tuple(lines)


@lru_cache(maxsize=1)
def tokenizer_json() -> str:
    """Train the byte-level BPE tokenizer (deterministic) and return its JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_corpus()), trainer=trainer)
    return str(tok.to_str())


@lru_cache(maxsize=1)
def tokenizer_vocab_size() -> int:
    data = json.loads(tokenizer_json())
    ids = set(data["model"]["vocab"].values()) | {t["id"] for t in data["added_tokens"]}
    assert ids == set(range(len(ids))), "tokenizer ids must be contiguous"
    return len(ids)


def save_tokenizer(out: Path, model_max_length: int = 512) -> None:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=Tokenizer.from_str(tokenizer_json()),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
