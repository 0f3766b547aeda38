"""Constrained decoding (structured outputs): what a request asks its output to obey
(grammar_spec), its compiled matcher whose token mask the sampler applies (constraint), and
the checks made before a request is admitted: that its grammar derives any text
(grammar_empty), what it costs per token (grammar_cost), and the bounds a JSON schema leaves
open (schema_bounds).
"""
