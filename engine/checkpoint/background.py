"""One write at a time on a thread beside training; its error is handed to the training thread at the next join."""
from __future__ import annotations

import threading


class BackgroundWrite:
    def __init__(self, name: str, daemon: bool = False):
        self.name, self.daemon = name, daemon
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, fn, *args) -> None:
        """Run fn(*args) on the thread; the caller has joined the previous write."""
        self._thread = threading.Thread(target=self._run, args=(fn, *args), name=self.name, daemon=self.daemon)
        self._thread.start()

    def _run(self, fn, *args) -> None:
        try:
            fn(*args)
        except BaseException as exc:  # raised in the training thread by the owner's wait()
            self._error = exc

    def join(self) -> BaseException | None:
        """Wait for the write in flight, if any; its error (once), or None."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        return error
