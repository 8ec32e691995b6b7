"""icml — the command-line workbench for ICML 2026 methods."""


def __getattr__(name: str):
    """`icml.cli.__version__`, read from the package metadata only when asked for: importlib.metadata
    costs a noticeable share of `icml --help`, which does not need it."""
    if name != "__version__":
        raise AttributeError(name)
    from importlib import metadata

    try:
        return metadata.version("icml")
    except metadata.PackageNotFoundError:  # running from a source tree that was never installed
        return "0+unknown"
