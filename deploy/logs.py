"""Logging setup for every kvserve process: one format, with the process name as a prefix.

The format is `time level [process-name] logger: message`, so the interleaved output of an engine
and its workers (`[engine]`, `[worker-1]`) stays readable. Only deploy/ configures handlers.
"""

import logging
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s [%(process_label)s] %(name)s: %(message)s"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class _ProcessLabelFilter(logging.Filter):
    """Stamps every record with the name of the process that wrote it."""

    def __init__(self, label: str) -> None:
        super().__init__()
        self.label = label

    def filter(self, record: logging.LogRecord) -> bool:
        record.process_label = self.label
        return True


def setup_logging(process_label: str, level: str = "INFO") -> None:
    """Send every log record of this process to stderr, prefixed with `[process_label]`."""
    if level.upper() not in LOG_LEVELS:
        raise ValueError(f"log level {level!r} is unknown: expected one of {list(LOG_LEVELS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ProcessLabelFilter(process_label))
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
