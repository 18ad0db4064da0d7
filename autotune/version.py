"""The package's version: one place, read by the library face, the CLI, what a study and a
result record, and the build (pyproject.toml's dynamic version). Imports nothing."""

__version__ = "0.1.0"
