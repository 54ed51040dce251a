"""Tokenizer and chat template, from a Hugging Face ``tokenizer.json`` or from GGUF metadata.

Both end up as a ``tokenizers.Tokenizer`` backend (GGUF vocabularies are rebuilt in gguf_vocab.py);
this class adds the chat template (sandboxed jinja2, as transformers renders it) and the special ids.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Encoding
from tokenizers import Tokenizer as HFTokenizer

from confkv_engine.model import token_bound
from confkv_engine.model.gguf_vocab import build_byte_level_bpe, build_spm_bpe
from confkv_engine.model.weights import ModelLoadError

log = logging.getLogger(__name__)


# Gemma's turn format, for GGUF files that carry no template (llama.cpp recognises such a vocabulary
# by its ``<start_of_turn>`` token and applies the same format): a system message is folded into the
# first user turn, the assistant's role is called ``model``.
GEMMA_TURN_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' }}"
    "{{ (prefix if loop.first else '') + (m['content'] | trim) + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# Control tokens that end a turn besides the declared EOS (llama.cpp treats them as end-of-generation).
_TURN_ENDS = ("<end_of_turn>",)


class ChatTemplateError(ValueError):
    """The chat template is missing or rejected the messages (``raise_exception`` in the template)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    return env.from_string(source)


class Tokenizer:
    """Encode/decode plus the chat template and the special ids the engine needs."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None,
        add_bos_token: bool = False,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.chat_template = chat_template
        # Whether the model expects BOS prepended to a raw completion prompt (the server decides).
        self.add_bos_token = add_bos_token
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        self.special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self.bos_token = backend.id_to_token(bos_token_id) if bos_token_id is not None else None
        self.eos_token = backend.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None
        # No token stands for more characters than this (None: no such bound for this vocabulary).
        self.longest_token_chars = token_bound.longest_token_chars(json.loads(backend.to_str()))
        self._piece_cache: dict[int, str] = {}
        self._piece_backend: HFTokenizer | None = None

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids; special tokens written in the text (e.g. ``<|im_start|>``) map to their ids."""
        ids = self._encode(text).ids
        if add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def encode_within(self, text: str, limit: int) -> tuple[int, list[int] | None]:
        """The token count of a prompt as the model is fed it, and its ids only when there are at
        most ``limit``: turning ids into a Python list holds the GIL (about 25 ms per million
        tokens), so an over-long text is counted and refused without that list. BOS is prepended
        when the tokenizer asks for it (``add_bos_token``; Gemma's and Llama 2's do) and the text
        does not start with it already (a chat template may write it), as vLLM's prompts get it."""
        encoding = self._encode(text)
        count = len(encoding)
        bos = self.bos_token_id if self.add_bos_token else None
        if bos is None:
            return count, (encoding.ids if count <= limit else None)
        if count + 1 > limit + 1:  # over even if the text starts with BOS itself
            return count + 1, None
        ids = encoding.ids
        if not ids or ids[0] != bos:
            ids = [bos, *ids]
        return len(ids), (ids if len(ids) <= limit else None)

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))`` from the text's length alone (``token_bound``);
        0 for a vocabulary without such a bound."""
        longest = self.longest_token_chars
        return token_bound.min_tokens(len(text), longest) if longest else 0

    def _encode(self, text: str) -> Encoding:
        # A batch call, not encode: only the batch calls release the GIL while they work, and the
        # server tokenizes on a worker thread so that a huge prompt never stalls its event loop.
        # The fast one skips the offsets (unused here): 2x quicker, and freeing its result holds
        # the GIL 5x shorter.
        return self.backend.encode_batch_fast([text], add_special_tokens=False)[0]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        """The token's text decoded on its own (an incomplete UTF-8 sequence decodes to U+FFFD);
        a SentencePiece word-start token keeps its leading space (" the", not "the")."""
        piece = self._piece_cache.get(token_id)
        if piece is None:
            if self._piece_backend is None:
                self._piece_backend = _without_strip(self.backend)
            piece = self._piece_backend.decode([token_id], skip_special_tokens=False)
            self._piece_cache[token_id] = piece
        return piece

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        try:
            return _compile_template(self.chat_template).render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    # ----- constructors -------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any]) -> Tokenizer:
        """``tokenizer.ggml.model`` 'gpt2' (byte-level BPE) or 'llama' (SentencePiece BPE with scores)."""
        kind = metadata.get("tokenizer.ggml.model")
        tokens: list[str] = metadata.get("tokenizer.ggml.tokens") or []
        types: list[int] = metadata.get("tokenizer.ggml.token_type") or []
        if kind == "gpt2":
            merges: list[str] = metadata.get("tokenizer.ggml.merges") or []
            if not tokens or not merges:
                raise ModelLoadError("GGUF tokenizer lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
            backend = build_byte_level_bpe(
                tokens, merges, types, metadata.get("tokenizer.ggml.pre", "default")
            )
        elif kind == "llama":
            scores: list[float] = metadata.get("tokenizer.ggml.scores") or []
            if not tokens or len(scores) != len(tokens):
                raise ModelLoadError("GGUF tokenizer lacks tokenizer.ggml.tokens or matching scores")
            prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
            backend = build_spm_bpe(tokens, scores, types, add_space_prefix=prefix)
        else:
            raise ModelLoadError(
                f"unsupported GGUF tokenizer model {kind!r} "
                "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)"
            )
        eos_ids = [
            metadata[key]
            for key in (
                "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.eot_token_id",
            )  # eot: Llama 3's <|eot_id|>
            if metadata.get(key) is not None
        ]
        eos_ids += [i for t in _TURN_ENDS if (i := backend.token_to_id(t)) is not None]
        template = metadata.get("tokenizer.chat_template")
        if template is None and backend.token_to_id("<start_of_turn>") is not None:
            template = GEMMA_TURN_TEMPLATE
        return cls(
            backend,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_ids,
            chat_template=template,
            # llama.cpp's default: BOS for SentencePiece vocabularies, none for byte-level BPE.
            add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"{path} has no tokenizer.json (only fast tokenizers are supported)")
        backend = HFTokenizer.from_file(str(tok_file))
        cfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")
        model_cfg = _read_json(path / "config.json")
        bos_id = _token_id(backend, cfg.get("bos_token"))
        if bos_id is None:
            bos_id = _first_id(gen.get("bos_token_id", model_cfg.get("bos_token_id")))
        eos_ids = [i for i in [_token_id(backend, cfg.get("eos_token"))] if i is not None]
        eos_ids += _id_list(gen.get("eos_token_id", model_cfg.get("eos_token_id")))
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:  # tokenizer.json's post-processor may add BOS itself (Llama 3)
            add_bos = bos_id is not None and backend.encode("a").ids[:1] == [bos_id]
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            chat_template=_hf_chat_template(path, cfg),
            add_bos_token=bool(add_bos),
        )


def _without_strip(backend: HFTokenizer) -> HFTokenizer:
    """A copy of ``backend`` whose decoder keeps leading spaces: SentencePiece decoders strip the
    prefix space of a whole text, which would also eat the space of a token decoded alone."""
    spec = json.loads(backend.to_str())
    decoder = spec.get("decoder") or {}
    if decoder.get("type") != "Sequence" or all(d.get("type") != "Strip" for d in decoder["decoders"]):
        return backend
    decoder["decoders"] = [d for d in decoder["decoders"] if d.get("type") != "Strip"]
    return HFTokenizer.from_str(json.dumps(spec))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc


def _token_id(backend: HFTokenizer, token: Any) -> int | None:
    """``bos_token``/``eos_token`` in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(token, dict):
        token = token.get("content")
    return backend.token_to_id(token) if isinstance(token, str) else None


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _first_id(value: Any) -> int | None:
    ids = _id_list(value)
    return ids[0] if ids else None


def _hf_chat_template(path: Path, cfg: dict[str, Any]) -> str | None:
    jinja_file = path / "chat_template.jinja"  # transformers >= 4.50 saves it separately
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if template is None and (path / "chat_template.json").is_file():
        template = _read_json(path / "chat_template.json").get("chat_template")
    return template
