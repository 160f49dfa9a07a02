"""Recipe for the bundled tiny model's config and tokenizer, reproducible offline.

The training text is generated from a fixed seed; it mixes case, accents, compatibility forms,
whitespace runs, digits, code and multi-byte scripts so that the compressed token map has real
merges to make (" The"/"the", whitespace-only tokens, partial UTF-8 byte tokens).

    python -m engramrt.bundled.recipe [OUT_DIR]   # default: both bundled directories
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engramrt.bundled import DEFAULT_MODEL_DIR, GQA_MODEL_DIR

SEED = 20261129
VOCAB_SIZE = 1024
SPECIAL_TOKENS = [
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜▁pad▁｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜image｜>",
]
BOS, EOS, PAD, _, _, IMAGE = range(len(SPECIAL_TOKENS))

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)

_WORDS = (
    "the of and to in is was for that with as on by at from it an be this which or are "
    "model token memory table hash layer stream copy gate value key prime row column engine "
    "request batch prefill decode verify history slot pipeline stage partition server client "
    "river mountain city garden window letter number music paper water light story house "
    "quick brown fox jumps over lazy dog small large early late bright quiet ancient modern "
    "run read write build serve measure compare learn find keep give take make see know "
    "café naïve résumé façade Zürich São Ångström über jalapeño piñata coöperate Øresund "
).split()
_NAMES = "Alice Bob Carol DeepSeek Engram Paris London Tokyo Lagos Lima Oslo".split()
_EXOTIC = ["ＡＢＣ", "ﬁle", "①", "™", "你好世界", "東京", "🙂", "🚀", "Ωmega", "ß", "İstanbul"]
_SPACES = [" ", " ", " ", " ", "  ", "\t", "\n", "\n\n", "   "]


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
    if rng.random() < 0.3:
        words[rng.randrange(len(words))] = rng.choice(_NAMES)
    if rng.random() < 0.15:
        words[rng.randrange(len(words))] = rng.choice(_EXOTIC)
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 10 ** rng.randint(1, 6))))
    style = rng.random()
    if style < 0.1:
        words = [w.upper() for w in words]
    elif style < 0.25:
        words = [w.capitalize() for w in words]
    text = rng.choice(_SPACES[:4]).join(words)
    return text[0].upper() + text[1:] + rng.choice(".!?;:,") + rng.choice(_SPACES)


def _code(rng: random.Random) -> str:
    name, arg = rng.choice(_WORDS[:40]), rng.choice("xyzn")
    return f"def {name}_{rng.randint(0, 9)}({arg}):\n    return {arg} * {rng.randint(2, 99)}\n\n"


def corpus(num_paragraphs: int = 3000) -> list[str]:
    rng = random.Random(SEED)
    out = []
    for _ in range(num_paragraphs):
        if rng.random() < 0.1:
            out.append(_code(rng))
        else:
            out.append("".join(_sentence(rng) for _ in range(rng.randint(1, 5))))
    return out


def train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def model_config(vocab: int, compressed_vocab: int) -> dict:
    """A DeepSeek-V4.1-shaped config scaled down; table sizes follow from the primes."""
    from engramrt.config import engram_config
    from engramrt.engram.layout import search_primes

    text = {
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 256,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-20,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "attention_type": "gqa",
        "ffn_type": "dense",
        "engram_layer_ids": [1, 2],
        "engram_num_embeddings": [0, 0],
        "engram_max_ngram_size": 4,
        "engram_n_heads": 8,
        "engram_head_dim": 32,
        "engram_vocab_size": 2048,
        "engram_pad_token_id": PAD,
        "engram_compressed_vocab_size": compressed_vocab,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "torch_dtype": "bfloat16",
    }
    raw = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "image_token_id": IMAGE,
        "text_config": text,
    }
    primes = search_primes(engram_config({**raw, "text_config": text}))
    text["engram_num_embeddings"] = [sum(sum(per_n) for per_n in layer) for layer in primes]
    return raw


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS],
        "eos_token": SPECIAL_TOKENS[EOS],
        "pad_token": SPECIAL_TOKENS[PAD],
        "add_bos_token": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }


def write(out_dir: Path, v41: bool = True) -> None:
    """The tokenizer and the config of the bundled V4.1 model (``v41``: the ``v41-tiny``
    preset's, whose vocabulary fields come from the GQA fixture's), or of the GQA fixture."""
    from engramrt.bundled.v41_presets import v41_preset_config
    from engramrt.engram.token_map import build_token_map

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    tok.save(str(out_dir / "tokenizer.json"))
    compressed = int(build_token_map(tok).max()) + 1
    config = model_config(tok.get_vocab_size(with_added_tokens=True), compressed)
    if v41:
        config = v41_preset_config("v41-tiny")
    for name, obj in (("config.json", config), ("tokenizer_config.json", tokenizer_config())):
        (out_dir / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":  # both bundled directories, or the V4.1 one's files in OUT_DIR
    if len(sys.argv) > 1:
        write(Path(sys.argv[1]))
    else:
        write(GQA_MODEL_DIR, v41=False)
        write(DEFAULT_MODEL_DIR)
