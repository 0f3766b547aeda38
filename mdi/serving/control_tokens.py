"""Which generated tokens the served text leaves out: the tokenizer's control tokens (chat
markers, BOS/EOS, Gemma 3's <start_of_image>...), never answer text, as vLLM leaves them out
by default (its request field `skip_special_tokens`, which mdi takes too) and llama.cpp's
server does. Control tokens are those `mdi.model.token_bytes.special_token_ids` names, the
ones a grammar never matches: a tokenizer.json's added tokens marked "special", a GGUF
vocabulary's control and unknown tokens (user-defined ones are text, as in llama.cpp),
GPT-2's <|endoftext|>, and the tokenizer's BOS and end ids; and Gemma's media markers
(<start_of_image>...): its tokenizer_config.json makes them special (extra_special_tokens, so
vLLM leaves them out) but its GGUF types them user-defined, as its "\n\n" tokens, which are text.

With tools, the markers the family's call parser reads (Llama 3's <|python_tag|>, <tool_call>
where a model has it as a control token) stay in the text it parses: calls are read by them,
and a <|python_tag|> that opens no call is still left out of the content. Log-probabilities
still list every generated token, a control token by its own text ("<|im_end|>"), as vLLM
and llama.cpp's server do."""
from typing import FrozenSet

from mdi.model.token_bytes import special_token_ids
from mdi.model.tokenizers import Tokenizer
from mdi.serving.tool_calls import MARKERS, PYTHON_TAG
from mdi.serving.tools import ToolFormat, single_token

# Gemma 3's (and 3n's) extra_special_tokens: markers of images and audio, never text of an answer
MEDIA_MARKERS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>", "<start_of_audio>", "<end_of_audio>",
                 "<audio_soft_token>")


class ControlTokens:
    """The server's control token ids, worked out once (Gemma 3's 262k types take ~20 ms)."""

    def __init__(self, tok: Tokenizer, fmt: ToolFormat) -> None:
        media = (single_token(tok, text) for text in MEDIA_MARKERS)
        self.ids = frozenset(special_token_ids(tok)) | {i for i in media if i is not None}
        markers = {text: single_token(tok, text) for text in MARKERS[fmt.family]}
        self.markers = frozenset(i for i in markers.values() if i is not None and i in self.ids)
        self.python_tag_is_control = markers.get(PYTHON_TAG) in self.ids

    def hidden(self, skip_special_tokens: bool, tools: bool) -> FrozenSet[int]:
        """The ids a request's text leaves out: none unless `skip_special_tokens`; with
        `tools`, the call markers stay for the parser."""
        if not skip_special_tokens:
            return frozenset()
        return self.ids - self.markers if tools else self.ids

