"""Command-line entry points, the local launcher and logging setup. Nothing imports deploy."""
