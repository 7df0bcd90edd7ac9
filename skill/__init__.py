"""The user-facing layer: CLI, config, ladder state and reports."""
