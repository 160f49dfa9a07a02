"""vLLM's tokenizer endpoints: /tokenize, /detokenize and /tokenizer_info, in vLLM's shapes.
lm-eval's remote tokenizer backend calls them instead of loading the tokenizer with
``transformers``. Ids come from the ``Server`` path a completion takes, so a client that
tokenises here and sends ids runs exactly what it would run sending the text."""

from __future__ import annotations

from engramrt.prompts import PromptEncoder
from engramrt.server.protocol import DetokenizeRequest, TokenizeRequest
from engramrt.server.responses import ApiError
from engramrt.server.serving import Server

# tokenizer_config.json keys naming files on the server's disk, of no use to a client
_FILE_KEYS = ("vocab_file", "merges_file", "tokenizer_file")


def tokenize(server: Server, req: TokenizeRequest) -> dict:
    """``{count, max_model_len, tokens, token_strs}``; ``token_strs`` are the vocabulary's
    pieces (``Ġthe``), only when asked for."""
    server.check_model(req.model)
    if req.messages is None:
        ids = server.encode(req.prompt or "", req.special())
    else:
        ids = server.chat_prompt(req.messages, req.add_generation_prompt, req.special())
    strs = [server.tok.id_to_token(t) for t in ids] if req.return_token_strs else None
    return {
        "count": len(ids),
        "max_model_len": server.cfg.max_model_len,
        "tokens": ids,
        "token_strs": strs,
    }


def detokenize(server: Server, req: DetokenizeRequest) -> dict:
    """``{prompt}``: the ids' text with special tokens kept, as an echoed prompt reads."""
    server.check_model(req.model)
    tok = server.tok
    size = tok.get_vocab_size(with_added_tokens=True)
    # the tokenizer would skip an unknown id silently; a client must hear of it
    bad = [t for t in req.tokens if not 0 <= t < size or tok.id_to_token(t) is None]
    if bad:
        msg = f"token ids {bad[:8]} are not in the tokenizer's vocabulary [0, {size})"
        raise ApiError(400, msg, param="tokens")
    return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}


def tokenizer_info(prompts: PromptEncoder) -> dict:
    """tokenizer_config.json as vLLM serves it: special tokens as their text, no file paths,
    ``tokenizer_class`` always; ``bos_token``, ``eos_token`` and ``pad_token`` are always
    there (null for none, never ``""``: lm-eval reads a token's id as the first id of its text,
    and checks for ``eos_token`` before it uses this server)."""
    info = {k: _as_text(v) for k, v in prompts.config.items() if k not in _FILE_KEYS}
    info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    for name in ("bos_token", "eos_token", "pad_token"):
        info[name] = info.get(name) or None
    return info


def _as_text(value):
    """Added tokens (``{"content": ..., "special": ...}``) as their text, anywhere in a value."""
    if isinstance(value, dict):
        if "content" in value:
            return value["content"]
        return {k: _as_text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_text(v) for v in value]
    return value
