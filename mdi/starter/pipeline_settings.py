"""What the starter's pipeline takes from the run plan, as one frozen value.

`Pipeline(...)` used to take these one keyword at a time, six of them copied from the plan by
the engine; `PipelineSettings.from_plan` makes them once, and a test or benchmark that builds a
pipeline by hand gives only those it changes.
"""
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from mdi.runconfig import DEFAULT_PREFILL_CHUNK, SpeculationSpec


@dataclass(frozen=True)
class PipelineSettings:
    max_batch: int = 1  # samples per frame
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # prompt tokens a pass carries at most
    context_shift: bool = False  # a full cache slot shifts the window instead of ending the sample
    speculation: SpeculationSpec = field(default_factory=SpeculationSpec)  # the run's (a sample may carry its own)
    n_stages: int = 1  # the boards of the ring (speculation's policy counts them)
    # Frames carry each sample's pass epoch once any sample may speculate (a served request may)
    tag_epochs: bool = False
    recv_timeout: float = 30.0  # seconds a step waits for a frame before the ring is deemed stuck
    # A ring with a node on ggml: prompts go in the passes mdi.starter.prompt_passes cuts, so
    # that a prompt row's bits do not depend on its pass (ggml's attention kernel does)
    ggml_cuts: bool = False
    # The ids a sample may draw: the tokenizer's, where the head is wider (Qwen2.5's pads 151665
    # ids to 151936; an id past the tokenizer had failed the decode of every sample); None: all
    drawable: Optional[int] = None

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.prefill_chunk < 1:
            raise ValueError("max_batch and prefill_chunk must be >= 1")

    @classmethod
    def from_plan(cls, plan: Any, tag_epochs: bool = False, ggml_cuts: bool = False,
                  drawable: Optional[int] = None) -> "PipelineSettings":
        """The settings of a run plan's ring (mdi.starter.planning.run_plan.RunPlan)."""
        gen = plan.cfg.generation
        return cls(max_batch=plan.max_batch, prefill_chunk=plan.prefill_chunk, context_shift=gen.context_shift,
                   speculation=gen.speculation, n_stages=len(plan.nodes), tag_epochs=tag_epochs,
                   recv_timeout=plan.cfg.runtime.ring_timeout, ggml_cuts=ggml_cuts, drawable=drawable)

    def for_ring(self, n_stages: int, ggml_cuts: bool) -> "PipelineSettings":
        """The same settings on a ring of `n_stages` boards (after a recovery)."""
        return replace(self, n_stages=n_stages, ggml_cuts=ggml_cuts)


def drawable_ids(source: Any) -> Optional[int]:
    """PipelineSettings.drawable for a model (mdi.model.source.ModelSource): its tokenizer's
    size where that is smaller than its head (check_vocab refuses a larger one), else None."""
    tok = source.tokenizer
    return tok.vocab_size if tok is not None and tok.vocab_size < source.config.vocab_size else None
