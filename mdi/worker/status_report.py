"""A worker's GET /status reply built from what it holds now (mdi.ring.status is the contract)."""
from typing import Any, List, Optional

from mdi import __version__
from mdi.ring.status import NodeCache, NodeCounters, NodeMemory, StatusReply, WorkerState
from mdi.system.cpu import cpu_info, isa_text
from mdi.system.memory import board_memory, free_bytes_on, rss_bytes, unified_memory_bytes
from mdi.worker.memory_budget import chunk_nbytes, training_bytes
from mdi.worker.run import Run


def status_reply(state: WorkerState, port: int, runs_served: int, threads: int, run: Optional[Run],
                 chunk: Optional[Any], layers: Optional[List[int]], device: str,
                 max_memory: Optional[int], capacity: Optional[int], backend_line: Optional[str] = None) -> StatusReply:
    """The reply for a worker in `state` holding `chunk` (its `layers`) on `device`, serving (or
    last served) `run`; `capacity` is what it can give a run (memory_budget.memory_limit)."""
    cache = chunk.cache if chunk is not None else None
    board = board_memory()  # tegrastats' unified RAM on a Jetson, else /proc/meminfo (the dashboard)
    reply = StatusReply(
        state=state, version=__version__, port=port, layers=layers, device=device,
        run_id=run.id if run else None, runs_served=runs_served, threads=threads,
        # Peaks count CUDA allocations too: on a Jetson they live in the same RAM (mdi.system.memory).
        memory=NodeMemory(rss_bytes(), unified_memory_bytes(peak=True), available_bytes=free_bytes_on(device),
                          max_memory_bytes=max_memory, chunk_bytes=chunk_nbytes(chunk),
                          adapter_bytes=chunk.adapter_bytes if chunk is not None else 0,
                          training_bytes=training_bytes(run),
                          unified_bytes=unified_memory_bytes(), board_used_bytes=board["used_bytes"],
                          board_total_bytes=board["total_bytes"], board_source=board["source"],
                          capacity_bytes=capacity),
        cache=NodeCache(cache.n_slots, cache.max_len, cache.nbytes) if cache else NodeCache(),
        error=run.error if run else None,
        kernels=_torch_kernels() if chunk is not None and chunk.backend == "torch" else {},
        cpu=isa_text(cpu_info()), kernels_here=_kernels_here(device),
        backend=chunk.backend if chunk is not None else None, backend_line=backend_line if chunk is not None else None)
    if run is not None:
        ep = run.endpoint
        reply.counters = NodeCounters(frames_received=ep.frames_received, frames_done=run.frames_done,
                                      compute_seconds=round(run.compute_seconds, 6),
                                      bad_frames=ep.bad_frames,
                                      last_bad_frame=ep.last_error, batching=run.batching,
                                      passes_cancelled=run.passes_cancelled, rows_cancelled=run.rows_cancelled,
                                      pass_seconds=run.pass_seconds, **ep.traffic())
        if run.prefix is not None:
            reply.prefix = run.prefix.stats
    return reply



def _torch_kernels() -> dict:
    from mdi.model.quantization import kernel_choice
    return kernel_choice.chosen_by_weight()


def _kernels_here(device: str) -> List[str]:
    """What runtime.quant_kernel fast may try here: torch's kernels, asked only where torch is
    loaded (a worker computing with ggml has none to offer and does not load torch to say so)."""
    import sys
    if "torch" not in sys.modules:
        return []
    from mdi.model.quantization import qkernels
    return qkernels.offered_on(device)
