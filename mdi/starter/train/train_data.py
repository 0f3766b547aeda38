"""mdi-train's data: a text file cut into windows, or JSONL examples one per window, each window
with the positions whose next-token prediction is scored; and which windows each step takes.

The defaults a reference can reproduce exactly (issue 38): a text file's ids are the model's
tokenizer's encoding of the whole text, no BOS added; window k is ids [k L, (k + 1) L), every
one of its L - 1 next-token predictions scored; step s takes windows [s B, (s + 1) B) in file
order, wrapping round to window 0 when the file runs out (epochs), with no shuffling.

A `.jsonl` file holds one example per line, each one window (one example per sequence):
  {"prompt": P, "completion": C}  ids = [BOS if the tokenizer adds one (its add_bos rule, as
      inference encodes a prompt)] + encode(P) + encode(C) + [EOS], each part encoded on its own
      (no BOS inside); the completion's tokens and the EOS are scored, so the model learns to
      stop where the completion ends.
  {"messages": [...]}  rendered with the model's chat template (the CLI renders it: the template
      lives with serving, above this layer) as pieces of text, the assistant turns' pieces scored
      (each from the end of the generation prompt before it to the end of the turn, the template's
      end-of-turn marker included); pieces are encoded one by one and joined.
A window longer than L is truncated (its first L tokens kept), a shorter one padded at the end
with unscored positions (EOS, or 0 without one): causal attention keeps the padding from
changing any scored prediction. An example left with no scored token is dropped (logged).

Shuffling (`--shuffle`) is a function of the seed and the step only: epoch e visits the windows
in the order of torch.randperm(n, generator seeded with seed * 1000003 + e), so a resumed run
takes the same windows as an uninterrupted one with no random state to carry.
"""
import json
import logging
import os
import stat
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from mdi.model.tokenizer_base import TokenizerError
from mdi.runconfig import ConfigError

log = logging.getLogger(__name__)

# A chat renderer: the messages -> [(text, scored)] pieces of the whole conversation (mdi.cli.train).
ChatRenderer = Callable[[List[Dict[str, Any]]], List[Tuple[str, bool]]]
SHUFFLE_EPOCH_STRIDE = 1000003


@dataclass
class Windows:
    """Training windows: ids [n, L] and scored [n, L] (scored[i, t]: ids[i, t] is a scored
    prediction from position t - 1; column 0 is never scored)."""
    ids: torch.Tensor
    scored: torch.Tensor
    path: str

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def take(self, index: torch.Tensor) -> "Windows":
        return Windows(self.ids[index], self.scored[index], self.path)

    @property
    def n_scored(self) -> int:
        return int(self.scored.sum().item())


def _read_text(path: str, what: str = "--data") -> str:
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ConfigError("%s %s: not a regular file" % (what, path))
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except FileNotFoundError:
        raise ConfigError("%s %s: no such file" % (what, path))
    except UnicodeDecodeError as e:
        raise ConfigError("%s %s: not UTF-8 text (%s)" % (what, path, e.reason))
    except OSError as e:
        raise ConfigError("%s %s: cannot read it: %s" % (what, path, e.strerror or e))


def _need_tokenizer(tokenizer: Any, path: str) -> None:
    if tokenizer is None:
        raise ConfigError("--data %s: the model has no tokenizer" % path)


def read_text_ids(tokenizer: Any, path: str) -> torch.Tensor:
    """The whole file's ids (int64), as the tokenizer encodes the text without BOS."""
    _need_tokenizer(tokenizer, path)
    return torch.tensor(tokenizer.encode_plain(_read_text(path)), dtype=torch.long)


def text_windows(ids: torch.Tensor, seq_len: int, path: str) -> torch.Tensor:
    """[windows, seq_len]: the whole windows of `ids` (a last partial one is dropped)."""
    n = ids.numel() // seq_len
    if n < 1:
        raise ConfigError("--data %s: %d tokens, shorter than one window of --seq-len %d" % (path, ids.numel(), seq_len))
    return ids[:n * seq_len].view(n, seq_len)


def load_windows(tokenizer: Any, path: str, seq_len: int, render_chat: Optional[ChatRenderer] = None,
                 what: str = "--data") -> Windows:
    """A text file's windows, or a .jsonl file's examples as windows (see the module docstring);
    ConfigError naming the file for text the tokenizer cannot encode."""
    try:
        return _load_windows(tokenizer, path, seq_len, render_chat, what)
    except TokenizerError as e:
        raise ConfigError("%s %s: %s" % (what, path, e))


def _load_windows(tokenizer: Any, path: str, seq_len: int, render_chat: Optional[ChatRenderer],
                  what: str) -> Windows:
    _need_tokenizer(tokenizer, path)
    if not path.endswith(".jsonl"):
        ids = text_windows(read_text_ids(tokenizer, path), seq_len, path)
        scored = torch.ones_like(ids, dtype=torch.bool)
        scored[:, 0] = False
        return Windows(ids, scored, path)
    rows: List[List[int]] = []
    masks: List[List[bool]] = []
    dropped = 0
    # JSON Lines end at "\n" alone: splitlines() also cut at U+2028 and the like, which JSON
    # strings may hold raw (json.dumps(..., ensure_ascii=False) writes them so)
    for number, line in enumerate(_read_text(path, what).split("\n"), 1):
        if not line.strip():
            continue
        where = "%s %s line %d" % (what, path, number)
        try:
            example = json.loads(line)
        except ValueError as e:
            raise ConfigError("%s: not JSON (%s)" % (where, e))
        except RecursionError:
            raise ConfigError("%s: JSON nested too deeply" % where) from None
        tokens, mask = _example(tokenizer, example, where, render_chat)
        tokens, mask = tokens[:seq_len], mask[:seq_len]
        if mask:
            mask[0] = False  # nothing predicts the first token
        if not any(mask):  # (an empty example too, with a tokenizer that adds no BOS or EOS)
            dropped += 1
            continue
        pad = seq_len - len(tokens)
        rows.append(tokens + [tokenizer.eos_id if tokenizer.eos_id is not None else 0] * pad)
        masks.append(mask + [False] * pad)
    if dropped:
        log.warning("mdi-train: %s %s: %d example(s) have no scored token in their first %d tokens: dropped",
                    what, path, dropped, seq_len)
    if not rows:
        raise ConfigError("%s %s: no example with a scored token in its first %d tokens" % (what, path, seq_len))
    return Windows(torch.tensor(rows, dtype=torch.long), torch.tensor(masks, dtype=torch.bool), path)


def _example(tokenizer: Any, example: Any, where: str,
             render_chat: Optional[ChatRenderer]) -> Tuple[List[int], List[bool]]:
    """One JSONL example's ids and which of them are scored."""
    if isinstance(example, dict) and "messages" in example:
        messages = example["messages"]
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ConfigError("%s: 'messages' must be a non-empty list of {role, content} objects" % where)
        if not any(m.get("role") == "assistant" for m in messages):
            raise ConfigError("%s: no assistant message to learn" % where)
        if render_chat is None:
            raise ConfigError("%s: chat examples need the model's chat template (mdi-train renders them)" % where)
        try:
            pieces = render_chat(messages)
        except ValueError as e:
            raise ConfigError("%s: %s" % (where, e))
        ids = [tokenizer.bos_id] if tokenizer.add_bos else []
        mask = [False] * len(ids)
        for text, scored in pieces:
            part = tokenizer.encode_plain(text) if text else []
            ids += part
            mask += [scored] * len(part)
        return ids, mask
    if isinstance(example, dict) and set(example) == {"prompt", "completion"} \
            and all(isinstance(example[k], str) for k in example):
        prompt = ([tokenizer.bos_id] if tokenizer.add_bos else []) + tokenizer.encode_plain(example["prompt"])
        completion = tokenizer.encode_plain(example["completion"])
        if tokenizer.eos_id is not None:
            completion.append(tokenizer.eos_id)
        return prompt + completion, [False] * len(prompt) + [True] * len(completion)
    raise ConfigError('%s: expected {"prompt": str, "completion": str} or {"messages": [...]}' % where)


def step_index(n: int, step: int, batch_size: int, shuffle: bool = False, seed: int = 0) -> torch.Tensor:
    """The indices of the windows step `step` takes: stream positions [step B, (step + 1) B),
    wrapping round the file (epochs); with `shuffle`, each epoch in its own seeded order."""
    positions = torch.arange(step * batch_size, (step + 1) * batch_size)
    if not shuffle:
        return positions % n
    out = torch.empty_like(positions)
    orders: Dict[int, torch.Tensor] = {}
    for i, p in enumerate(positions.tolist()):
        epoch = p // n
        if epoch not in orders:
            orders[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(
                seed * SHUFFLE_EPOCH_STRIDE + epoch))
        out[i] = orders[epoch][p % n]
    return out


def step_windows(windows: torch.Tensor, step: int, batch_size: int) -> torch.Tensor:
    """[batch_size, seq_len]: windows [step B, (step + 1) B), wrapping round the file."""
    return windows[step_index(windows.shape[0], step, batch_size)]


def eval_batches(windows: Windows, batch_size: int) -> Sequence[Windows]:
    """Held-out windows in file order, batch_size at a time (the last batch may be smaller)."""
    return [windows.take(torch.arange(i, min(i + batch_size, len(windows)))) for i in range(0, len(windows), batch_size)]
