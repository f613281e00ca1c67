"""The one table of compiled steps: every variant's executables by key ((tokens, pages) bucket and
the variant's tag), with each one's input layout, compiled ahead of time at warm-up and run once
there; a key needed later is compiled then, and counted (`unplanned_compiles`)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

from jaxserve.model.transfer import Layout
from jaxserve.runner.compilation import compile_buckets

logger = logging.getLogger(__name__)


class ExecutableTable:
    def __init__(self, lower: Callable[[tuple], tuple[Any, Layout]], compiler_options: dict, platform: str):
        self._lower = lower  # key -> (lowered step, its inputs' layout)
        self.compiler_options = compiler_options
        self.platform = platform
        self.executables: dict[tuple, Any] = {}
        self.layouts: dict[tuple, Layout] = {}
        self.unplanned_compiles = 0  # keys that were not in the warmed table
        # Calls that ran an executable for the first time: on a CPU such a call takes ~15 ms more than
        # the next ones (measured), so timings of those steps are not representative.
        self.first_runs = 0
        self.ran: set[tuple] = set()
        self.warmed = False  # compile_all ran: a compile after it was not foreseen (--enforce-eager: none ran)

    def __len__(self) -> int:
        return len(self.executables)

    def lower(self, key: tuple) -> Any:
        lowered, self.layouts[key] = self._lower(key)
        return lowered

    def get(self, key: tuple, planned: bool = True) -> Any:
        """Key's executable, compiled now if it is not yet (`planned` False: counted and logged as a
        compile the warm-up did not foresee)."""
        executable = self.executables.get(key)
        if executable is None:
            if not planned:
                self.unplanned_compiles += 1
                logger.log(logging.WARNING if self.warmed else logging.INFO, "compiling unplanned step %s", key)
            executable = self.executables[key] = self.lower(key).compile(self.compiler_options)
        return executable

    def layout(self, key: tuple) -> Layout:
        """Key's input layout (lowering it, and so compiling it unplanned, if need be)."""
        if key not in self.layouts:
            self.get(key, planned=False)
        return self.layouts[key]

    def first_run(self, key: tuple) -> None:
        """Note a call of key's executable (its first: counted in `first_runs`)."""
        if key not in self.ran:
            self.ran.add(key)
            self.first_runs += 1

    def compile_all(self, keys: Iterable[tuple], progress: bool = True) -> list[tuple[tuple, float]]:
        """Compile the keys not compiled yet (`compilation.compile_buckets`); (key, seconds) of each."""
        self.warmed = True
        keys = [k for k in keys if k not in self.executables]
        logger.info("compiling %d step buckets: %s", len(keys), keys)
        timings = []
        for key, executable, seconds in compile_buckets(
            keys, self.lower, self.compiler_options, self.platform, progress
        ):
            self.executables[key] = executable
            timings.append((key, seconds))
            logger.info("bucket %s compiled in %.2fs", key, seconds)
        return timings

    def clear(self) -> None:
        self.executables.clear()
        self.layouts.clear()
        self.ran.clear()
