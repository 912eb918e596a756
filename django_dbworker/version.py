"""The package's version, in a module of its own so that any layer can read it.

(``tracing`` names it on its tracer; importing it from the package's
``__init__`` would make an import cycle through the lazy public API.)
"""

from __future__ import annotations

__version__ = "0.1.0"
