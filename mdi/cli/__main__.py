"""`python -m mdi.cli` runs mdi-start, as it did when the CLI was one module."""
import sys

from mdi.cli.start import start_main

sys.exit(start_main())
