"""Planning a run: what each node can do (measured speeds, memory, links: node_speeds,
loop_timing), what a run needs (capacity, node_budget, run_shape), the layer split over the
ring (planner, autoplan), the one plan value the run is built from (run_plan, serving_plan),
the checks that say whether it fits before anything is generated (preflight), and the new plan
when a worker dies (recovery). Nothing here drives samples through the ring: it decides the
ring that others drive.
"""
