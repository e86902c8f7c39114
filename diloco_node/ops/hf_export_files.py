"""The files beside a Hugging Face export's weights that make it a complete model for `transformers`:
`tokenizer_config.json` and `special_tokens_map.json` (with the site's tokenizer.json), and
`generation_config.json`, with the bos and eos ids taken from the site's tokenizer when the
operator gives none.

`AutoTokenizer.from_pretrained` reads tokenizer.json through `tokenizer_config.json`'s
`tokenizer_class` ("PreTrainedTokenizerFast": the tokenizers library's file as it is, no
sentencepiece model); `special_tokens_map.json` names the bos and eos tokens; `generate()` reads
its bos, eos and pad ids from `generation_config.json`.

eos is found as the learner finds a document's end (learn/documents.py `find_eos`): a
`tokenizer_config.json` beside the tokenizer.json, the token its post-processor appends, a special
token of a well-known name. bos the same way: declared, prepended by the post-processor, or a
special token of a well-known name; a tokenizer without one (GPT-2's) exports bos null.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
FILES = frozenset({TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_FILE, GENERATION_CONFIG_FILE})
# The class transformers builds from a bare tokenizer.json (no slow tokenizer's files needed).
TOKENIZER_CLASS = "PreTrainedTokenizerFast"
# Beginning-of-sequence tokens by the names tokenizers in common use give them (Llama 2 and 3,
# Gemma, GPT-NeoX chat variants), tried in this order when the tokenizer declares none.
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "[BOS]")


class TokenizerFilesError(ValueError):
    """The tokenizer cannot give bos/eos ids, or a given id is not one of its; the message says which."""


def special_ids(tokenizer_path: Path) -> tuple[int | None, int | None]:
    """(bos id, eos id) of a tokenizer.json: bos None when it has none; eos always (or an error)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TokenizerFilesError("reading bos/eos from the tokenizer needs the tokenizers package "
                                  "(pip install -e '.[tokenizers]'), or pass --bos-token-id and --eos-token-id") from None
    from diloco_node.learn.documents import DocumentError, find_eos

    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
    except Exception as error:  # the library raises its own exception types for a bad file
        raise TokenizerFilesError(f"cannot read the tokenizer {tokenizer_path}: {error}") from None
    try:
        eos, _ = find_eos(tokenizer, str(tokenizer_path))
    except DocumentError as error:
        raise TokenizerFilesError(f"{error} (or pass --eos-token-id)") from None
    return _find_bos(tokenizer, tokenizer_path), eos


def _find_bos(tokenizer: Any, tokenizer_path: Path) -> int | None:
    config = tokenizer_path.with_name(TOKENIZER_CONFIG_FILE)
    if config.is_file():
        try:
            declared = json.loads(config.read_text()).get("bos_token")
        except (OSError, ValueError, AttributeError):
            declared = None
        if isinstance(declared, dict):
            declared = declared.get("content")
        if isinstance(declared, str) and tokenizer.token_to_id(declared) is not None:
            return int(tokenizer.token_to_id(declared))
    described = json.loads(tokenizer.to_str())
    prepended = _post_processor_bos(described.get("post_processor"))
    if prepended and tokenizer.token_to_id(prepended) is not None:
        return int(tokenizer.token_to_id(prepended))
    specials = {token.get("content") for token in described.get("added_tokens") or [] if token.get("special")}
    for name in BOS_NAMES:
        if name in specials and tokenizer.token_to_id(name) is not None:
            return int(tokenizer.token_to_id(name))
    for name in BOS_NAMES:  # in the vocabulary without being marked special (a word-level tokenizer's)
        if tokenizer.token_to_id(name) is not None:
            return int(tokenizer.token_to_id(name))
    return None


def _post_processor_bos(processor: Any) -> str | None:
    """The special token a TemplateProcessing post-processor puts before a single sequence ($A)."""
    if not isinstance(processor, dict):
        return None
    if processor.get("type") == "Sequence":
        for inner in processor.get("processors") or []:
            found = _post_processor_bos(inner)
            if found:
                return found
        return None
    if processor.get("type") != "TemplateProcessing":
        return None
    for piece in processor.get("single") or []:
        if isinstance(piece, dict) and "Sequence" in piece:
            return None
        if isinstance(piece, dict) and "SpecialToken" in piece:
            return piece["SpecialToken"].get("id")
    return None


def token_text(tokenizer_path: Path, token_id: int | None) -> str | None:
    """The token's text in the tokenizer (None for None); an id outside it is an error."""
    if token_id is None:
        return None
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(tokenizer_path)).id_to_token(token_id)
    if text is None:
        raise TokenizerFilesError(f"token id {token_id} is not an id of the tokenizer {tokenizer_path}")
    return text


def write_files(directory: Path, *, seq_len: int, bos_token_id: int | None, eos_token_id: int | None,
                bos_token: str | None = None, eos_token: str | None = None, with_tokenizer: bool) -> list[str]:
    """Write generation_config.json, and with a tokenizer its tokenizer_config.json and
    special_tokens_map.json, into `directory`; the names written."""
    # generate() pads finished sequences of a batch; eos is what a Llama pads with. No max_length:
    # set here, transformers warns on every generate(max_new_tokens=...) call.
    generation = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": eos_token_id}
    written = [GENERATION_CONFIG_FILE]
    _write_json(directory / GENERATION_CONFIG_FILE, generation)
    if with_tokenizer:
        specials = {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v is not None}
        _write_json(directory / SPECIAL_TOKENS_FILE, specials)
        _write_json(directory / TOKENIZER_CONFIG_FILE, {
            "tokenizer_class": TOKENIZER_CLASS, "model_max_length": seq_len, **specials,
            "pad_token": eos_token, "clean_up_tokenization_spaces": False})
        written += [SPECIAL_TOKENS_FILE, TOKENIZER_CONFIG_FILE]
    return written


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
