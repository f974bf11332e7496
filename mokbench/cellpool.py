"""Cells at once, and stopping them: ``mokbench sweep --parallel N`` runs up to N cells side by
side on one node, each on GPUs of its own; SIGTERM (scripts, job schedulers) stops a sweep as
Ctrl-C does, and a stopped sweep stops every cell it runs (their process groups) and writes
no rows for them, so ``--resume`` runs them again."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from mokbench.launch import CellRunner, LaunchOptions


class SweepStopped(KeyboardInterrupt):
    """SIGTERM during a sweep, handled as Ctrl-C: the running cell's process group is killed
    (``launch.run_process``), finished rows are kept, ``--resume`` completes the run."""


@contextlib.contextmanager
def stop_on_sigterm():
    """Turn SIGTERM into :class:`SweepStopped` while a sweep runs (main thread only). Why:
    without it the sweep process dies at once and leaves the running cell's torchrun, which
    has its own process group, running on the GPUs; scripts and job schedulers stop a job
    with SIGTERM, and a shell's background job ignores SIGINT."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, _frame):
        raise SweepStopped(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_parallel(runner: CellRunner, todo: list, opts: LaunchOptions, started, finished
                  ) -> None:
    """Up to ``opts.parallel`` cells at once, in sweep order (a cell that needs more GPUs than
    are free waits for them; no cell overtakes it). A cell of world size W gets W free GPUs of
    the node; on CPU every cell counts as one. Ctrl-C or SIGTERM stops every running cell
    (no rows for them) and propagates."""
    ids = opts.gpu_ids()
    free = list(ids)
    pending = deque(todo)
    running: dict = {}
    with ThreadPoolExecutor(max_workers=opts.parallel) as pool:
        try:
            while pending or running:
                while pending and len(running) < opts.parallel:
                    index, cell = pending[0]
                    need = cell.scenario.world_size if ids else 0
                    if need > len(ids):  # cannot be placed: runner.run writes the skip rows
                        need = 0
                    if need > len(free):
                        break
                    gpus = tuple(free[:need])
                    del free[:need]
                    pending.popleft()
                    started(cell)
                    running[pool.submit(runner.run, cell, index, gpus or None)] = (cell, gpus)
                done, _ = wait(running, timeout=0.5, return_when=FIRST_COMPLETED)
                for future in done:
                    cell, gpus = running.pop(future)
                    free = sorted(free + list(gpus), key=ids.index)
                    finished(cell, future.result())
        except BaseException:
            runner.stop_all()
            raise
