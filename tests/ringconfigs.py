"""The one factory for the run configs the tests start: a starter and its workers (and spares)
on loopback, as the YAML-like dict that `mdi.runconfig` reads, parsed, or written to a file.

    run_config_dict(model)                                  # one node (no `nodes`)
    parse_run_config(model, workers[:2], layers=[1, 2, 1], n_tokens=12, runtime={"ring_timeout": 20})
    write_run_config(tmp_path / "ring.yaml", model, workers, worker_name="board%d", serve={...})

Workers are anything with a `.port` (WorkerProcess, an in-process Worker) or a bare port number.
Every node gets a data-plane port of its own (free ones unless `data_ports` names them), so rings
started side by side on one machine never meet. Sampling is greedy unless `generation` says otherwise."""
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import yaml

from mdi.lab.processes import free_ports
from mdi.runconfig import RunConfig, parse_config

Layers = Union[None, int, str, Sequence[Any]]


def _port(worker: Any) -> int:
    return worker if isinstance(worker, int) else worker.port


def ring_nodes(workers: Sequence[Any] = (), layers: Layers = None, data_ports: Any = None,
               starter_port: Optional[int] = 1, worker_name: str = "w%d", spares: Sequence[Any] = (),
               spare_name: str = "spare%d", node_options: Optional[Mapping[int, Mapping[str, Any]]] = None,
               ) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """(nodes, spares) as config dicts: "starter" then `worker_name % 1, 2...`, spares `spare_name % 1...`
    (numbered on after the workers where spare_name is worker_name).

    layers: None: no `layers` (a balanced split); a count or "auto": the same on every node; a list:
    per node. data_ports: None: free ones, one per node and spare; a list: those, in that order;
    an empty one: none (the nodes' defaults). starter_port: the starter's HTTP port, None: the
    default (1 by default: nothing dials a batch run's starter, and it never collides with a
    worker). node_options: keys to add per node, by index in `nodes` (0 is the starter)."""
    if data_ports is None:
        data_ports = free_ports(1 + len(workers) + len(spares))
    nodes = [{"name": "starter"}]  # type: List[Dict[str, Any]]
    if starter_port is not None:
        nodes[0]["port"] = starter_port
    nodes += [{"name": worker_name % (i + 1), "port": _port(w)} for i, w in enumerate(workers)]
    first_spare = len(workers) + 1 if spare_name == worker_name else 1  # one numbering for boards named alike
    spare_nodes = [{"name": spare_name % (first_spare + i), "port": _port(w)} for i, w in enumerate(spares)]
    if data_ports:
        for node, data_port in zip(nodes + spare_nodes, data_ports):
            node["data_port"] = data_port
    if layers is not None:
        counts = [layers] * len(nodes) if isinstance(layers, (int, str)) else list(layers)
        assert len(counts) == len(nodes), "layers %r for %d nodes" % (layers, len(nodes))
        for node, count in zip(nodes, counts):
            node["layers"] = count
    for i, options in (node_options or {}).items():
        nodes[i].update(options)
    return nodes, spare_nodes


def run_config_dict(model: str, workers: Sequence[Any] = (), layers: Layers = None, data_ports: Any = None,
                    starter_port: Optional[int] = 1, worker_name: str = "w%d", spares: Sequence[Any] = (),
                    spare_name: str = "spare%d", node_options: Optional[Mapping[int, Mapping[str, Any]]] = None,
                    quant: Optional[str] = None, device: Optional[str] = None, dtype: Optional[str] = None,
                    compute_dtype: Optional[str] = None, adapters: Optional[Mapping[str, str]] = None,
                    n_tokens: Optional[int] = None, generation: Optional[Mapping[str, Any]] = None,
                    runtime: Optional[Mapping[str, Any]] = None, serve: Optional[Mapping[str, Any]] = None,
                    ) -> Dict[str, Any]:
    """A run config as a dict. The ring (see ring_nodes) is left out for one node with no
    workers and no `layers`: the starter alone. generation: over {"temperature": 0} (and
    `n_tokens`); runtime, serve, adapters: as given; quant/device/dtype/compute_dtype: model keys."""
    data = {"model": {"path": model}}  # type: Dict[str, Any]
    for key, value in (("quant", quant), ("device", device), ("dtype", dtype), ("compute_dtype", compute_dtype)):
        if value is not None:
            data["model"][key] = value
    if adapters is not None:
        data["adapters"] = dict(adapters)
    if workers or spares or layers is not None:
        data["nodes"], spare_nodes = ring_nodes(workers, layers, data_ports, starter_port, worker_name, spares,
                                                spare_name, node_options)
        if spare_nodes:
            data["spares"] = spare_nodes
    data["generation"] = {"temperature": 0}
    if n_tokens is not None:
        data["generation"]["n_tokens"] = n_tokens
    data["generation"].update(generation or {})
    if runtime is not None:
        data["runtime"] = dict(runtime)
    if serve is not None:
        data["serve"] = dict(serve)
    return data


def parse_run_config(model: str, workers: Sequence[Any] = (), label: str = "test", **options: Any) -> RunConfig:
    """run_config_dict(model, workers, **options), parsed as the config file `label`."""
    return parse_config(run_config_dict(model, workers, **options), label)


def write_run_config(path: Any, model: str, workers: Sequence[Any] = (), **options: Any) -> str:
    """run_config_dict(model, workers, **options) written as YAML at `path`; the path, a str."""
    with open(str(path), "w") as f:
        yaml.safe_dump(run_config_dict(model, workers, **options), f)
    return str(path)
