"""mdi-train's data: a text file cut into windows, and which windows each step takes.

The defaults a reference can reproduce exactly (issue 38): the file's ids are the model's
tokenizer's encoding of the whole text, no BOS added; window k is ids [k L, (k + 1) L), every
one of its L - 1 next-token predictions scored; step s takes windows [s B, (s + 1) B) in file
order, wrapping round to window 0 when the file runs out (epochs), with no shuffling.
"""
import os
import stat
from typing import Any

import torch

from mdi.runconfig import ConfigError


def read_text_ids(tokenizer: Any, path: str) -> torch.Tensor:
    """The whole file's ids (int64), as the tokenizer encodes the text without BOS."""
    if tokenizer is None:
        raise ConfigError("--data %s: the model has no tokenizer" % path)
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ConfigError("--data %s: not a regular file" % path)
        with open(path, encoding="utf-8", newline="") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError("--data %s: no such file" % path)
    except UnicodeDecodeError as e:
        raise ConfigError("--data %s: not UTF-8 text (%s)" % (path, e.reason))
    except OSError as e:
        raise ConfigError("--data %s: cannot read it: %s" % (path, e.strerror or e))
    return torch.tensor(tokenizer.encode_plain(text), dtype=torch.long)


def text_windows(ids: torch.Tensor, seq_len: int, path: str) -> torch.Tensor:
    """[windows, seq_len]: the whole windows of `ids` (a last partial one is dropped)."""
    n = ids.numel() // seq_len
    if n < 1:
        raise ConfigError("--data %s: %d tokens, shorter than one window of --seq-len %d" % (path, ids.numel(), seq_len))
    return ids[:n * seq_len].view(n, seq_len)


def step_windows(windows: torch.Tensor, step: int, batch_size: int) -> torch.Tensor:
    """[batch_size, seq_len]: windows [step B, (step + 1) B), wrapping round the file."""
    index = torch.arange(step * batch_size, (step + 1) * batch_size) % windows.shape[0]
    return windows[index]
