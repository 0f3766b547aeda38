"""How big a run is, decided in one place: the samples it holds, its KV cache slots and the
positions each slot keeps.

Every entry point that sizes a run asks here: a batch run (`mdi-start`), its check
(`mdi-start --check`), `mdi-plan` and serving (`--serve`). Each used to derive the positions per
slot by its own rule: only the batch run counted a soft prompt's virtual tokens, `--check` never
saw `--n-samples`, and mdi-plan encoded prompts without the tokenizer's BOS. A check could pass
for a run that then allocated more than it checked.
"""
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from mdi.model.config import ModelConfig
from mdi.model.source import ModelSource
from mdi.runconfig import FLAGS_SOURCE, ConfigError, RunConfig
from mdi.starter.adapter_set import AdapterSet, adapter_ids
from mdi.starter.sample import Sample, make_samples

DEFAULT_SERVING_MAX_LEN = 2048  # positions per slot when serve.max_len is not set (capped by the context)


@dataclass(frozen=True)
class RunShape:
    n_slots: int  # KV cache slots on every node: the samples (or requests) in flight at once
    max_len: int  # positions per slot: prompt, a soft prompt's virtual tokens and generated tokens


def expand_prompts(cfg: RunConfig, cli_prompts: Sequence[str], cli_n_samples: Optional[int]) -> List[str]:
    """The run's prompts, one per sample: the command line's (else the config's), repeated in
    turn up to --n-samples (else generation.n_samples)."""
    prompts = list(cli_prompts) or cfg.generation.prompts
    if not prompts:
        raise ConfigError("no prompt: give --prompt TEXT (or generation.prompts in %s)"
                          % ("a --config file" if cfg.source == FLAGS_SOURCE else cfg.source))
    if cli_n_samples is not None:
        if cli_n_samples < len(prompts):
            raise ConfigError("--n-samples %d is smaller than the %d prompts given" % (cli_n_samples, len(prompts)))
        n = cli_n_samples
    else:
        n = max(cfg.generation.n_samples or 0, len(prompts))
    if n < 1:
        raise ConfigError("--n-samples must be at least 1")
    return [prompts[i % len(prompts)] for i in range(n)]


def encode_prompts(source: ModelSource, prompts: Sequence[str]) -> List[List[int]]:
    """Each prompt's ids as the run feeds them (the tokenizer's BOS included), refused in one
    line when one cannot fit the model's context."""
    tok = source.tokenizer
    if tok is None:
        raise ConfigError("%s: no tokenizer found for this model" % source.path)
    block = source.config.block_size
    out = []
    for p in prompts:
        ids = tok.encode_prompt(p)
        if len(ids) >= block:
            raise ConfigError("prompt of %d tokens does not fit the model's context of %d tokens"
                              % (len(ids), block))
        out.append(ids)
    return out


def batch_samples(cfg: RunConfig, source: ModelSource, prompts: Sequence[str],
                  adapters: Sequence[str] = ()) -> Tuple[List[Sample], Optional[AdapterSet]]:
    """The samples a batch run generates, each with its adapter (`mdi-start --adapter`, one per
    prompt in order) and a soft prompt's virtual tokens before its prompt, and the adapters."""
    gen = cfg.generation
    samples = make_samples(list(prompts), encode_prompts(source, prompts), gen.n_tokens, gen.seed)
    adapter_set = AdapterSet(cfg.adapters, source.config) if cfg.adapters else None
    for sample, adapter in zip(samples, adapter_ids(adapter_set, adapters, len(samples))):
        if adapter_set is not None:
            adapter_set.prepare(sample, adapter)
    return samples, adapter_set


def batch_shape(config: ModelConfig, samples: Sequence[Sample], n_tokens: int,
                max_len: Optional[int] = None) -> RunShape:
    """One slot per sample, each as long as the longest prompt (virtual tokens included) plus
    the tokens to generate, at most the model's context: a sample that reaches its end stops
    there (finish_reason "context"), or with generation.context_shift rolls its window on.
    `max_len` (mdi-plan --max-len) replaces that length, within the context too."""
    longest = max([len(s.prompt_ids) for s in samples] or [0])
    if longest >= config.block_size:
        raise ConfigError("prompt of %d tokens (with its adapter's virtual tokens) does not fit the model's context "
                          "of %d tokens" % (longest, config.block_size))
    return RunShape(len(samples), min(config.block_size, max_len or max(longest, 1) + n_tokens))


def planning_shape(cfg: RunConfig, source: ModelSource, samples: Optional[int],
                   max_len: Optional[int]) -> RunShape:
    """What `mdi-plan` plans for: `samples` (refused below the config's prompts; else the run's,
    generation.n_samples or its prompts, the more; else two per node: every node busy) slots, as
    long as the batch run of the config's prompts would make them, or `max_len`."""
    gen = cfg.generation
    if samples is not None and samples < len(gen.prompts):  # (its run would hold every prompt)
        raise ConfigError("--samples %d is smaller than the %d prompts of %s's generation.prompts"
                          % (samples, len(gen.prompts), cfg.source))
    n = samples or max(gen.n_samples or 0, len(gen.prompts)) or 2 * len(cfg.nodes)
    prompts = [gen.prompts[i % len(gen.prompts)] for i in range(n)] if gen.prompts else []
    planned, _ = batch_samples(cfg, source, prompts) if prompts and source.tokenizer is not None else ([], None)
    return RunShape(n, batch_shape(source.config, planned, gen.n_tokens, max_len).max_len)


def serving_max_len(cfg: RunConfig, block_size: int) -> int:
    """Positions per serving slot: serve.max_len, else the context capped at DEFAULT_SERVING_MAX_LEN
    (the slots themselves are fitted to the nodes' memory once the layers are placed)."""
    asked = cfg.serve.max_len
    if asked is None:
        return min(block_size, DEFAULT_SERVING_MAX_LEN)
    if asked > block_size:
        raise ConfigError("%s: serve.max_len: %d is longer than the model's context of %d tokens"
                          % (cfg.source, asked, block_size))
    return asked
