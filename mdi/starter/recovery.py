"""Re-planning the ring after a worker died.

The starter keeps every sample's full token history, so any new ring can rebuild the caches
by re-prefilling and generation goes on with exactly the output it would have had. This
module only decides the new ring: a listed spare takes the dead node's place and layers, or,
without one, the dead node's layers go to its ring neighbours if their memory allows.
"""
from dataclasses import dataclass
from typing import Callable, List, Optional

from mdi.model.layout import format_layers
from mdi.runconfig import NodeSpec


class RecoveryImpossible(RuntimeError):
    pass


@dataclass
class Plan:
    nodes: List[NodeSpec]  # ring order, the starter first
    ranges: List[List[int]]  # half-open layer range per node
    how: str  # one line for the log, e.g. "spare2 replaces board1"
    spare: Optional[NodeSpec] = None  # the spare this plan takes into the ring


def plan_recovery(nodes: List[NodeSpec], ranges: List[List[int]], dead: str, spares: List[NodeSpec],
                  fits: Callable[[int, NodeSpec, List[int]], bool]) -> Plan:
    """Replace the dead worker by the first spare, else merge its layers into its neighbours.

    `fits(i, node, layers)` says whether node i of the current ring can hold `layers`; it is
    asked only about nodes whose range grows.
    """
    i = next((k for k, n in enumerate(nodes) if n.name == dead), None)
    if i is None or i == 0:
        raise RecoveryImpossible("node %s is not a worker of this ring" % dead)
    if spares:
        spare = spares[0]
        new_nodes = nodes[:i] + [spare] + nodes[i + 1:]
        return Plan(new_nodes, [list(r) for r in ranges], "spare %s (%s) takes %s of %s"
                    % (spare.name, spare.address, format_layers(*ranges[i]), dead), spare)
    first, last = ranges[i]
    options = []  # (layers to predecessor) candidates, most balanced first
    if i + 1 < len(nodes):
        half = first + (last - first + 1) // 2
        options = [half, last, first]
    else:
        options = [last]  # the last worker's layers can only go back to its predecessor
    for cut in options:
        grown_prev = [ranges[i - 1][0], cut]
        grown_next = [cut, ranges[i + 1][1]] if i + 1 < len(nodes) else None
        if cut > first and not fits(i - 1, nodes[i - 1], grown_prev):
            continue
        if grown_next is not None and cut < last and not fits(i + 1, nodes[i + 1], grown_next):
            continue
        new_ranges = [list(r) for r in ranges[:i - 1]] + [grown_prev]
        if grown_next is not None:
            new_ranges += [grown_next] + [list(r) for r in ranges[i + 2:]]
        return Plan(nodes[:i] + nodes[i + 1:], new_ranges, "%s's %s go to %s"
                    % (dead, format_layers(first, last), _names(nodes, i, cut, first, last)))
    raise RecoveryImpossible("no spare left and %s's neighbours cannot hold its %s"
                             % (dead, format_layers(first, last)))


def _names(nodes: List[NodeSpec], i: int, cut: int, first: int, last: int) -> str:
    takers = []
    if cut > first:
        takers.append(nodes[i - 1].name)
    if cut < last:
        takers.append(nodes[i + 1].name)
    return " and ".join(takers)
