"""What every mdi tokenizer is (`Tokenizer`: encode with or without BOS, decode, save to a
prepared directory, a lower bound on a text's token count) and the one error they raise; the
kinds live in mdi.model.tokenizers and mdi.model.spm_tokenizer."""
import os
from typing import Dict, List, Optional, Sequence

from mdi.system.files import write_json

META_FILE = "tokenizer_mdi.json"


class TokenizerError(ValueError):
    """A tokenizer could not be built, loaded or applied; the message says why in one line."""


class PromptTooLong(TokenizerError):
    """A text that cannot fit `limit` tokens, known without tokenizing it: it has at least
    `at_least` tokens."""

    def __init__(self, at_least: int, limit: int) -> None:
        super().__init__("the prompt has at least %d tokens, more than %d" % (at_least, limit))
        self.at_least, self.limit = at_least, limit


class Tokenizer:
    kind = ""

    def __init__(self, vocab_size: int, bos_id: Optional[int] = None, eos_id: Optional[int] = None,
                 add_bos: bool = False, chat_template: Optional[str] = None,
                 stop_ids: Optional[Sequence[int]] = None, add_eos: bool = False) -> None:
        self.vocab_size = vocab_size
        self.bos_id = bos_id
        self.eos_id = eos_id
        # Other ids that end a generation as EOS does (Llama 3.1 Instruct: <|end_of_text|>,
        # <|eom_id|> besides <|eot_id|>), as llama.cpp's end-of-generation set.
        self.stop_ids = sorted({int(i) for i in stop_ids or ()} - {eos_id})
        for i in self.stop_ids:
            if not 0 <= i < vocab_size:
                raise TokenizerError("stop token id %d out of range for a vocabulary of %d" % (i, vocab_size))
        self.add_bos = bool(add_bos)
        self.chat_template = chat_template
        if self.add_bos and bos_id is None:
            raise TokenizerError("add_bos is set but the %s tokenizer has no BOS token" % self.kind)
        # EOS after a prompt (a GGUF's tokenizer.ggml.add_eos_token, as llama.cpp's tokenizing
        # with add_special: llama-simple's prompt ends with it)
        self.add_eos = bool(add_eos)
        if self.add_eos and eos_id is None:
            raise TokenizerError("add_eos is set but the %s tokenizer has no EOS token" % self.kind)

    @property
    def end_ids(self) -> List[int]:
        """Every id that ends a generation: EOS and the stop ids."""
        return ([self.eos_id] if self.eos_id is not None else []) + self.stop_ids

    def encode(self, text: str) -> List[int]:
        ids = self._encode(text)
        if self.add_bos:
            assert self.bos_id is not None  # __init__ refuses add_bos without a BOS token
            ids = [self.bos_id] + ids
        if self.add_eos:
            assert self.eos_id is not None  # and add_eos without EOS
            ids = ids + [self.eos_id]
        return ids

    def encode_plain(self, text: str) -> List[int]:
        """The ids of `text` alone, no BOS: a piece of a longer text encoded piece by piece."""
        return self._encode(text)

    def encode_text(self, text: str) -> List[int]:
        """`encode_plain`, where the spelling of a control token ("<|im_end|>", "<eos>") is
        text, not that token: llama.cpp's tokenizing with parse_special false, as
        llama-perplexity reads its file (user-defined tokens are still cut out, as there)."""
        return self._encode_text(text)

    def max_token_bytes(self) -> Optional[int]:
        """The most UTF-8 bytes of text one token can stand for, where that bounds a text's
        token count from below (no normalizer that could shrink the text first); else None."""
        return None

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)), without tokenizing (0 where none is known)."""
        most = self._max_token_bytes_cached()
        return -(-len(text.encode("utf-8", "surrogatepass")) // most) if most else 0

    def _max_token_bytes_cached(self) -> Optional[int]:
        if not hasattr(self, "_max_bytes"):
            self._max_bytes = self.max_token_bytes()
        return self._max_bytes

    def encode_prompt(self, text: str, max_tokens: Optional[int] = None) -> List[int]:
        """`encode`, never empty: a model needs a first token, so an empty prompt starts from
        BOS (else EOS). With `max_tokens`, a text that cannot fit is refused (PromptTooLong)
        before it is tokenized: tokenizing a 1 MiB prompt only to refuse it took seconds and
        ~120 MB that glibc kept (16 at once left a server 2 GB larger)."""
        if max_tokens is not None:
            at_least = self.fewest_tokens(text) + self.add_bos + self.add_eos
            if at_least > max_tokens:
                raise PromptTooLong(at_least, max_tokens)
        ids = self.encode(text)
        if ids:
            return ids
        start = self.bos_id if self.bos_id is not None else self.eos_id
        if start is None:
            raise TokenizerError("the prompt is empty and the tokenizer has no BOS/EOS token to start from")
        return [start]

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise TokenizerError("token id %d out of range for a %s vocabulary of %d"
                                     % (i, self.kind, self.vocab_size))
        return self._decode(ids)

    def save(self, model_dir: str) -> None:
        os.makedirs(model_dir, exist_ok=True)
        self._save_files(model_dir)
        meta: Dict[str, object] = {"kind": self.kind, "bos_id": self.bos_id, "eos_id": self.eos_id,
                "add_bos": self.add_bos, "chat_template": self.chat_template}
        if self.stop_ids:
            meta["stop_ids"] = self.stop_ids
        if self.add_eos:  # (absent, as in files written before it)
            meta["add_eos"] = True
        write_json(os.path.join(model_dir, META_FILE), meta)

    def __repr__(self) -> str:
        return "<%s tokenizer vocab=%d bos=%s eos=%s add_bos=%s>" % (
            self.kind, self.vocab_size, self.bos_id, self.eos_id, self.add_bos)

    def _encode(self, text: str) -> List[int]:
        raise NotImplementedError

    def _encode_text(self, text: str) -> List[int]:
        return self._encode(text)  # a tokenizer whose control tokens no text spells

    def _decode(self, ids: List[int]) -> str:
        raise NotImplementedError

    def _save_files(self, model_dir: str) -> None:
        raise NotImplementedError
