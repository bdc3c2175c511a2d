"""Run a function on N local processes joined in one process group, with a deadline; or a module
in a fresh interpreter, with one; and end a ``torchrun`` process without the abort at its exit.

For trying a pipeline on one machine without ``torchrun`` (tests, benchmarks, notebooks). Every
collective gets the same timeout, and the parent stops waiting at the deadline and ends the
workers, so a mistake that leaves one rank waiting for another cannot hang the caller.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import multiprocessing
import os
import pickle
import queue
import signal
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, NoReturn

import torch.distributed as dist

from autoshard.errors import LaunchError


def _worker(fn: Callable[..., Any], rank: int, world_size: int, port: int, backend: str,
            timeout: float, args: tuple[Any, ...], results: Any, environment: dict[str, str]) -> None:
    faulthandler.dump_traceback_later(max(timeout - 5.0, 1.0))  # a stuck worker shows where, on stderr
    os.environ.clear()  # the caller's now, as a spawned process would get it (not the fork server's)
    os.environ.update(environment)
    try:
        # A client of the parent's store, given to the group: no rendezvous reads torchrun's environment
        # (``TORCHELASTIC_USE_AGENT_STORE`` would join a store nobody serves here)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        # every rank connected before any goes on: one whose work is done at once (a check, a rank
        # with nothing to send) could tear down its side while another still connects to it (gloo's
        # "Connection closed by peer" in connectFullMesh, seen on a loaded 2-core machine)
        if world_size > 1:
            dist.barrier()
        try:
            results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent as text
        results.put((rank, False, traceback.format_exc()))


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...] = (),
    *,
    timeout: float = 300.0,
    backend: str = "gloo",
) -> list[Any]:
    """``[fn(rank, world_size, *args) for each rank]``, each run in a process of its own (``_context``).

    ``fn`` must be importable (defined at module level) and return something picklable. Raises
    ``LaunchError`` with every worker's traceback if one fails or the deadline passes.
    """
    context = _context()
    results = context.Queue()
    # The parent serves the group's store on a port it binds and keeps: a port found free and handed
    # on could be taken by another launch in between (two test workers met on one, and a rank joined
    # the other's group)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    port = store.port
    workers = [
        context.Process(target=_worker, daemon=True,
                        args=(fn, rank, world_size, port, backend, timeout, args, results, dict(os.environ)))
        for rank in range(world_size)
    ]
    for worker in workers:
        worker.start()
    deadline = time.monotonic() + timeout
    done: dict[int, tuple[bool, Any]] = {}
    try:
        while len(done) < world_size and time.monotonic() < deadline:
            if any(not ok for ok, _ in done.values()):
                deadline = min(deadline, time.monotonic() + 10.0)  # peers of a failed rank may be stuck
            try:
                rank, ok, payload = results.get(timeout=0.5)
                done[rank] = (ok, payload)
            except queue.Empty:
                for rank, worker in enumerate(workers):
                    if rank not in done and worker.exitcode not in (None, 0):
                        done[rank] = (False, f"process exited with code {worker.exitcode}")
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
            worker.join(timeout=10.0)
    failures = [f"rank {rank}:\n{payload}" for rank, (ok, payload) in sorted(done.items()) if not ok]
    missing = [rank for rank in range(world_size) if rank not in done]
    if failures or missing:
        late = f"ranks {missing} did not finish within {timeout:.0f} s\n" if missing else ""
        raise LaunchError(f"{fn.__name__} failed on {world_size} processes:\n{late}" + "\n".join(failures))
    return [pickle.loads(done[rank][1]) for rank in range(world_size)]


def _context() -> Any:
    """Where it can, a fork server that has imported torch and this module once: each rank then
    starts as a fork of it in a fraction of a second, where a spawned one imports torch anew (seconds
    a launch on a 2-core machine). Like a spawned process, and unlike a fork of the caller, a rank
    starts with no threads, CUDA state or objects of the caller's; it imports the caller's modules
    as it unpickles ``fn``, and takes the caller's environment as it is at the launch."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context


def run_module(module: str, timeout: float) -> subprocess.CompletedProcess:
    """Run ``python -m module`` and return its output (text), as ``subprocess.run(..., check=True)``
    would. The interpreter imports what this one does: this process's ``sys.path`` goes first on its
    ``PYTHONPATH``, so a script that found autoshard through ``sys.path.insert`` runs the same copy,
    not an installed one. It runs in a session of its own, killed whole when the call ends early
    (``timeout``, Ctrl-C): the processes it started (``run_local``'s workers) end with it rather
    than load the machine until their own deadline."""
    env = dict(os.environ)
    paths = [os.fspath(entry) for entry in sys.path if isinstance(entry, (str, os.PathLike)) and os.fspath(entry)]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env["PYTHONPATH"]] if env.get("PYTHONPATH") else paths)
    with subprocess.Popen([sys.executable, "-m", module], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env, start_new_session=True) as child:
        try:
            out, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_session(child)
            out, err = child.communicate()
            raise subprocess.TimeoutExpired(child.args, timeout, out, err) from None
        except BaseException:
            _kill_session(child)
            raise
    if child.returncode:
        raise subprocess.CalledProcessError(child.returncode, child.args, out, err)
    return subprocess.CompletedProcess(child.args, 0, out, err)


def _kill_session(child: subprocess.Popen) -> None:
    """Kill ``child`` and every process of its session; where there are no sessions (Windows), ``child``."""
    if hasattr(os, "killpg"):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
    else:
        child.kill()


def leave_process_group(exit_code: int = 0) -> NoReturn:
    """End this process after its last collective: wait for every rank (none tears its connections down
    while another's last sends are in flight), destroy the process group, flush the output and exit
    without finalising the interpreter, as ``multiprocessing``'s workers (``run_local``'s) do.

    Why not return from ``main``: gloo's worker threads hold each finished collective's tensors a
    moment after ``wait()`` returns, and one dropping a tensor a Python object refers to needs the
    interpreter lock; under load that can fall in the interpreter's finalisation, where taking the lock
    ends the thread by an unwinding C++ cannot pass, and the process aborts ("terminate called without
    an active exception", SIGABRT) after its work is done (seen on this project's CI; PyTorch's
    attempt to destroy groups at exit, pytorch/pytorch#179291, was abandoned). ``atexit`` handlers do
    not run: call this last, from the main thread of a ``torchrun`` script."""
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # (a closed or detached stream has nothing left to write)
            stream.flush()
    os._exit(exit_code)
