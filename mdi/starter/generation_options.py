"""A request's generation options: one frozen value that the serving `Request` holds and the
starter's `Sample` keeps as `sample.options` (vLLM's Request holds one `sampling_params`), so
each option has one name from the HTTP body's parsing to the pipeline. Mutable per-request
state (its compiled grammar, events, cancellation, text) stays on the request and the sample."""
import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

from mdi.model.constraints.grammar_spec import GrammarSpec
from mdi.model.sampling import SamplingParams
from mdi.runconfig import SpeculationSpec


@dataclass(frozen=True)
class GenerationOptions:
    max_tokens: int  # tokens it may generate (the sample's max_new_tokens)
    params: SamplingParams  # its sampling (temperature, top_k, penalties, logit_bias, ...)
    seed: Optional[int] = None  # None: a random one when it starts
    stop: Tuple[str, ...] = ()  # stop strings (empty ones dropped: they would match anywhere)
    adapter: int = 0  # the LoRA adapter's id it asked for (0: the base model)
    speculation: Optional[SpeculationSpec] = None  # None: the server's generation.speculation
    top_logprobs: Optional[int] = None  # None: no logprobs; else each token's and this many alternatives'
    cache_prompt: bool = True  # may start from what the prefix cache holds (the sample's reuse_prefix)
    grammar: Optional[GrammarSpec] = None  # None: free text; else what every token drawn must keep valid
    stop_token_ids: Tuple[int, ...] = ()  # ids that end it as the model's end tokens do (vLLM's)
    min_tokens: int = 0  # no end token (nor stop_token_ids) drawn before this many tokens
    ignore_eos: bool = False  # the model's end tokens do not end it (a grammar's end still does)
    include_stop_str: bool = False  # its text keeps the stop string it ends at

    def __post_init__(self) -> None:
        # Normalised once here, so every holder reads the same value (a frozen dataclass sets
        # its own fields through object.__setattr__).
        object.__setattr__(self, "max_tokens", int(self.max_tokens))
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))

    def with_seed(self, seed: Optional[int]) -> "GenerationOptions":
        """The same options with another seed (a request's further choices: seed + i)."""
        return dataclasses.replace(self, seed=seed)
