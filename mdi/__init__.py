"""mdi: run one language model across several small boards joined in a ring."""
from mdi import old_paths

__version__ = "0.1.0"

# Modules that moved into sub-packages still import under their old names (mdi.old_paths).
old_paths.install()
