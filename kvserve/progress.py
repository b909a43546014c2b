"""BatchProgress: the progress bar `LLM.generate` shows over one batch (rich), or nothing when
use_tqdm is off. It only draws; it never waits on anything.
"""

from types import TracebackType

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)


class BatchProgress:
    """Prompts finished of the batch, and output tokens so far."""

    def __init__(self, num_prompts: int, is_shown: bool) -> None:
        self._progress: Progress | None = None
        self._num_output_tokens = 0
        if is_shown:
            self._progress = Progress(
                TextColumn("generating"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[num_tokens]} output tokens"),
                TimeElapsedColumn(),
                transient=False,
            )
            self._task_id = self._progress.add_task("", total=num_prompts, num_tokens=0)

    def advance(self, num_output_tokens: int) -> None:
        """One more prompt finished, with this many output tokens."""
        self._num_output_tokens += num_output_tokens
        if self._progress is not None:
            self._progress.update(self._task_id, advance=1, num_tokens=self._num_output_tokens)

    def __enter__(self) -> "BatchProgress":
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.stop()
