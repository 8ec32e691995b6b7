"""icml — the command-line workbench for ICML 2026 methods."""
from importlib import metadata

try:
    __version__ = metadata.version("icml")
except metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
