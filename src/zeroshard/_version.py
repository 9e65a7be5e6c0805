"""The package version, in a module of its own so that modules needing it (checkpoint
manifests, ``--version``) do not import the package's ``__init__`` (an import cycle)."""

__version__ = "0.1.0"
