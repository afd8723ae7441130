"""The genie version (read by the build, see setup.py)."""

__version__ = "0.1.0"
