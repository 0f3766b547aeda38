"""One compute graph of a chunk: its context, its inputs and output, and the compute buffer
its intermediates live in; inputs written and the output read through numpy views of their
memory where it is the host's."""
from typing import Any, Dict, Optional

import numpy as np

from mdi.model.ggml import adapters as lora_ops
from mdi.model.ggml import lib


class Built:
    """One graph, its inputs and output, and the compute buffer its intermediates live in (a
    buffer of `buffer_type`: the device's the graph computes on; None: the CPU's)."""

    def __init__(self, nodes: int, buffer_type: Optional[int] = None) -> None:
        gg = lib.require()
        self.buffer_type = buffer_type
        self.ctx = lib.Context(nodes, nodes)  # a tensor per node at most, and the graph's own lists
        self.graph = gg.ggml_new_graph_custom(self.ctx.ptr, nodes, False)
        self.inputs: Dict[str, Any] = {}
        self.output: Any = None
        self.lora: Optional[lora_ops.LoraOps] = None  # a pass's adapter ops (mdi.model.ggml.adapters)
        self.galloc: Optional[int] = None
        self.buffer_bytes = 0
        self.last_lookup = 0  # the owner's count of graph lookups when this one was last asked for
        self._views: Dict[str, Any] = {}  # input name (or "" for the output) -> host view, or False

    def _view(self, name: str, tensor: Any) -> Any:
        view = self._views.get(name)
        if view is None:  # made once: a graph's tensors keep their place in its buffer
            view = lib.host_view(tensor)
            view = self._views[name] = False if view is None else view
        return view

    def set(self, name: str, values: np.ndarray) -> None:
        """Write input `name`'s values (as many as it holds; converted to its type): straight
        into its memory where the buffer is the host's, else through ggml's copy."""
        view = self._view(name, self.inputs[name])
        if view is False:
            lib.set_data(self.inputs[name], values)
            return
        if values.size != view.size:
            raise ValueError("%d values for input %s of %d" % (values.size, name, view.size))
        view[:] = values.reshape(-1)

    def rows_out(self, rows: int) -> np.ndarray:
        """The first `rows` rows of the float32 output [rows, width], copied out (the next
        compute reuses its memory)."""
        out = self.output
        width = int(out.contents.ne[0])
        view = self._view("", out)
        if view is False:
            full = lib.get_data(out, np.empty((int(out.contents.ne[1]), width), dtype=np.float32))
            return full[:rows]
        return view[:rows * width].reshape(rows, width).copy()

    def finish(self, output: Any) -> None:
        """`output` is what the graph computes: mark it, build the graph up to it, allocate."""
        gg = lib.require()
        gg.ggml_set_output(output)
        gg.ggml_build_forward_expand(self.graph, output)
        self.output = output
        self.allocate()

    def allocate(self) -> None:
        gg = lib.require()
        self.galloc = gg.ggml_gallocr_new(lib.cpu_buffer_type() if self.buffer_type is None else self.buffer_type)
        if not gg.ggml_gallocr_alloc_graph(self.galloc, self.graph):
            raise MemoryError("ggml could not allocate a graph's compute buffer")
        self.buffer_bytes = gg.ggml_gallocr_get_buffer_size(self.galloc, 0)
        self._views.clear()

    def free(self) -> None:
        gg = lib.gg
        if self.galloc is not None and gg is not None:
            gg.ggml_gallocr_free(self.galloc)
            self.galloc = None
        self.ctx.free()

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:
            pass
