"""mdi: run one language model across several small boards joined in a ring."""
__version__ = "0.1.0"
