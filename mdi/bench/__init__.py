"""mdi-bench's parts; the command itself is mdi/experiments.py."""
