"""The one place genie's version is written (packaging reads it too: ``[tool.hatch.version]``).

A leaf module: it imports nothing, so any module of the package may import it without
pulling in the package face (``genie/__init__.py``) and its runtime.
"""

__version__ = "0.1.0"
