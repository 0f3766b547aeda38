"""One compute graph of a chunk: its context, its inputs and output, and the compute buffer
its intermediates live in; inputs written and the output read through numpy views of their
memory where it is the host's."""
from typing import Any, Dict, Optional, Sequence, Union

import numpy as np

from mdi.model.ggml import adapters as lora_ops
from mdi.model.ggml import lib


class Built(lib.Freed):
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
        self._out_grid: Any = None  # the output's host view as [rows, width], or False (rows_out)
        self._grids: Dict[str, np.ndarray] = {}  # a mask's [rows, width]: its host view, or a device's copy

    def _view(self, name: str, tensor: Any) -> Any:
        view = self._views.get(name)
        if view is None:  # made once: a graph's tensors keep their place in its buffer
            view = lib.host_view(tensor)
            view = self._views[name] = False if view is None else view
        return view

    def set(self, name: str, values: Union[np.ndarray, Sequence[int]]) -> None:
        """Write input `name`'s values (as many as it holds; converted to its type; a list of
        numbers too, a decode step's few): straight into its memory where the buffer is the
        host's, else through ggml's copy."""
        tensor = self.inputs[name]
        view = self._view(name, tensor)
        if view is False:
            lib.set_data(tensor, np.asarray(values, dtype=lib.number_dtype(tensor)))
            return
        n = values.size if isinstance(values, np.ndarray) else len(values)
        if n != view.size:
            raise ValueError("%d values for input %s of %d" % (n, name, view.size))
        view[:] = values.reshape(-1) if isinstance(values, np.ndarray) else values

    def fill_band(self, name: str, first: int, end: int, outside: Any) -> None:
        """Input `name`, a mask [rows, width]: 0 in columns [first, end) of every row, `outside`
        in the others (every time whole: ggml's allocator lends an input's memory to the nodes
        after its last reader)."""
        grid = self._grids.get(name)
        if grid is None:  # made once, as _view's (a ctypes field read costs microseconds on a cold step)
            tensor = self.inputs[name]
            view = self._view(name, tensor)
            shape = (int(tensor.contents.ne[1]), int(tensor.contents.ne[0]))
            grid = np.empty(shape, dtype=lib.number_dtype(tensor)) if view is False else view.reshape(shape)
            self._grids[name] = grid
        grid[:] = outside
        grid[:, max(0, first):max(0, end)] = 0
        if self._views[name] is False:  # (a device's memory: the grid is the host's copy)
            lib.set_data(self.inputs[name], grid)

    def rows_out(self, rows: int, copy: bool = True) -> np.ndarray:
        """The first `rows` rows of the float32 output [rows, width], copied out (the next
        compute reuses its memory), or, `copy` False, a view of it where it is the host's."""
        grid = self._out_grid
        if grid is None:  # the output's host view as [rows, width] (made once, as _view's)
            out = self.output
            view = self._view("", out)
            grid = self._out_grid = False if view is False else view.reshape(-1, int(out.contents.ne[0]))
        if grid is False:
            out = self.output
            full = lib.get_data(out, np.empty((int(out.contents.ne[1]), int(out.contents.ne[0])), dtype=np.float32))
            return full[:rows]
        return grid[:rows].copy() if copy else grid[:rows]

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
        self._out_grid = None
        self._grids.clear()

    def free(self) -> None:
        gg = lib.gg
        if self.galloc is not None and gg is not None:
            gg.ggml_gallocr_free(self.galloc)
            self.galloc = None
        self.ctx.free()
