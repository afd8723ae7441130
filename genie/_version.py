"""The one place genie's version is written (the build reads it too: ``[tool.setuptools.dynamic]``).

A leaf module: it imports nothing, so any module of the package may import it without
pulling in the package face (``genie/__init__.py``) and its runtime.
"""

__version__ = "0.1.0"
