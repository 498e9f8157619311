"""The worker process behind ``AsynchronousDataAccessor``.

A child process iterates over the dataset (any Python iterable, usually a
``poptorchsim.DataLoader``) and puts each item into a bounded queue of
``buffer_size`` items: it runs ahead of the consumer by up to that many
items and waits, checking the host's commands every
``miss_sleep_time_in_ms``, when the queue is full.  torch.multiprocessing's
queue moves the items' tensors into shared memory, so the host receives
them without a copy.

The host and the worker count epochs.  Every message from the worker names
the epoch it belongs to, and the host drops messages of an epoch it has
abandoned (an iteration stopped early and restarted).  Host -> worker:
``("start", epoch)`` (start loading that epoch; the worker restarts its
iterator only for an epoch later than its own, never for one it has
already begun or, running ahead, already queued in full) and
``("shutdown",)``.  Worker -> host: ``("ready",)`` once, then ``(epoch,
"item", data)``, ``(epoch, "eof")`` and ``(epoch, "error", text)``.

As PopTorch's worker, this one loads the first item as soon as it starts
(so an empty dataset fails at construction), then waits for the host's
first ``start`` unless ``early_preload``; with ``load_indefinitely`` it
begins the next epoch as soon as one ends.
"""
import logging
import os
import pickle
import queue
import sys
import tempfile
import traceback

import torch
import torch.multiprocessing as multiprocessing
import torch.utils._pytree as pytree

from ..enums import SharingStrategy
from ..errors import Error

START_FAILED_ERR = ("AsynchronousDataAccessor worker thread failed to start "
                    "(Check above for details)")
FLAT_ERR = ("Tensor at index {index} is not a torch tensor ({kind}). "
            "AsynchronousDataAccessor expects data to be organised as a flat 1D "
            "container of tensors.")
_CONTEXTS = {SharingStrategy.Fork: "fork", SharingStrategy.ForkServer: "forkserver",
             SharingStrategy.SharedMemory: "spawn", SharingStrategy.FileSystem: "spawn"}
_POLL_S = 0.05


class Rebatcher:
    """Cuts a stream of batches into batches of ``size`` rows (dim 0 of
    every tensor); ``flush`` returns the last, smaller batch unless
    ``drop_last``."""

    def __init__(self, size, drop_last):
        self.size, self.drop_last = size, drop_last
        self.reset()

    def reset(self):
        self.parts, self.rows, self.spec = [], 0, None

    def add(self, item):
        leaves, self.spec = pytree.tree_flatten(item)
        for index, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                raise Error(FLAT_ERR.format(index=index, kind=type(leaf)))
        done, start, n = [], 0, leaves[0].shape[0]
        while start < n:
            take = min(self.size - self.rows, n - start)
            self.parts.append([t[start:start + take] for t in leaves])
            self.rows, start = self.rows + take, start + take
            if self.rows == self.size:
                done.append(self._emit())
        return done

    def flush(self):
        out = [self._emit()] if self.rows and not self.drop_last else []
        self.reset()
        return out

    def _emit(self):
        leaves = [torch.cat(column) for column in zip(*self.parts)]
        batch = pytree.tree_unflatten(leaves, self.spec)
        self.parts, self.rows = [], 0
        return batch


class Worker:
    """Host side: starts the worker process and talks to it."""

    def __init__(self, dataset, buffer_size, miss_sleep_time_in_ms, load_indefinitely,
                 early_preload, sharing_strategy, rebatched_size, rebatched_drop_last):
        ctx = multiprocessing.get_context(_CONTEXTS[SharingStrategy(sharing_strategy)])
        if ctx.get_start_method() == "forkserver":
            # the fork server imports PyTorch and poptorchsim once, before it
            # starts: each worker it forks has them (a worker importing them
            # itself took 5-6 s to start on a 2-core machine). No effect on a
            # fork server already running.
            ctx.set_forkserver_preload(["__main__", "torch", "poptorchsim"])
        self.commands = ctx.SimpleQueue()
        self.data = ctx.Queue(maxsize=buffer_size)
        settings = dict(start_method=multiprocessing.get_start_method(),
                        miss_sleep_s=miss_sleep_time_in_ms / 1000.0,
                        load_indefinitely=load_indefinitely, early_preload=early_preload,
                        rebatched_size=rebatched_size, drop_last=rebatched_drop_last)
        with tempfile.TemporaryDirectory() as folder:
            if sharing_strategy == SharingStrategy.FileSystem:
                # the dataset may not fit in shared memory: the worker reads a file
                path = os.path.join(folder, "dataset.pkl")
                with open(path, "wb") as f:
                    pickle.dump(dataset, f, protocol=4)
                dataset = path
            self.process = ctx.Process(target=_main,
                                       args=(dataset, self.commands, self.data, settings),
                                       name="AsynchronousDataAccessor")
            self.process.start()
            self._wait_ready()

    def _wait_ready(self):
        while True:
            try:
                message = self.data.get(timeout=_POLL_S)
            except queue.Empty:
                if not self.process.is_alive():
                    raise Error(START_FAILED_ERR) from None
                continue
            if message[0] == "ready":
                return
            # as PopTorch: the worker's error printed, then "failed to start"
            # (here with the worker's error in the message too)
            self.terminate()
            print(message[2], file=sys.stderr)
            raise Error(f"{START_FAILED_ERR}: {message[2]}")

    def start(self, epoch):
        self.commands.put(("start", epoch))

    def next_message(self):
        """The next message; an error if the worker died."""
        while True:
            try:
                return self.data.get(timeout=_POLL_S)
            except queue.Empty:
                if not self.process.is_alive():
                    raise self._died() from None
            except (EOFError, OSError):        # its shared memory went with it
                raise self._died() from None

    def _died(self):
        self.process.join(timeout=1)
        return Error("An error occurred in the data fetcher: the worker process exited "
                     f"(code {self.process.exitcode})")

    def terminate(self):
        """Asks the worker to stop, then makes sure it has."""
        if self.process.is_alive():
            try:
                self.commands.put(("shutdown",))
            except (BrokenPipeError, OSError):
                pass
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()
        self.data.cancel_join_thread()
        self.data.close()


class _Producer:
    """Worker side: the loading loop."""

    def __init__(self, dataset, commands, data, settings):
        self.dataset, self.commands, self.data = dataset, commands, data
        self.s = settings
        self.epoch, self.loading, self.shutdown = 0, settings["early_preload"], False
        self.iterator = iter(dataset)
        size = settings["rebatched_size"]
        self.rebatcher = Rebatcher(size, settings["drop_last"]) if size else None

    def handle(self, command):
        if command[0] == "shutdown":
            self.shutdown = True
        elif command[1] > self.epoch:            # the host abandoned an epoch: restart
            self.epoch, self.iterator = command[1], iter(self.dataset)
            if self.rebatcher:
                self.rebatcher.reset()
            self.loading = True
        else:
            # this epoch (equal) or one this worker ran ahead past (lower: with
            # load_indefinitely, every item and the eof of that epoch are queued
            # already, in order). Restarting it would queue a second copy of
            # the epoch behind items of the next one, which the host would take
            # as that epoch's (its first batch twice, each later one shifted by one)
            self.loading = True

    def poll(self, block=False):
        if block:
            self.handle(self.commands.get())
        while not self.shutdown and not self.commands.empty():
            self.handle(self.commands.get())

    def put(self, message):
        """Queues ``message``, waiting while the queue is full; False if a
        command (shutdown, another epoch) came first."""
        epoch = self.epoch
        while True:
            try:
                self.data.put(message, timeout=max(self.s["miss_sleep_s"], 1e-5))
                return True
            except queue.Full:
                self.poll()
                if self.shutdown or self.epoch != epoch:
                    return False

    def emit(self, item):
        batches = self.rebatcher.add(item) if self.rebatcher else [item]
        epoch = self.epoch
        for batch in batches:
            if not self.put((epoch, "item", batch)):
                return

    def end_of_epoch(self):
        epoch = self.epoch
        for batch in self.rebatcher.flush() if self.rebatcher else []:
            if not self.put((epoch, "item", batch)):
                return
        if not self.put((epoch, "eof")):
            return
        if self.s["load_indefinitely"]:
            self.epoch, self.iterator = epoch + 1, iter(self.dataset)
        else:
            self.loading = False

    def run(self, first):
        self.emit(first)
        while not self.shutdown:
            self.poll(block=not self.loading)
            if self.shutdown or not self.loading:
                continue
            try:
                item = next(self.iterator)
            except StopIteration:
                self.end_of_epoch()
                continue
            self.emit(item)
        self.data.cancel_join_thread()     # items nobody will read: exit now


def _main(dataset, commands, data, settings):
    """The worker process: one thread (as torch's DataLoader workers), the
    dataset loaded, its first item read, then the loading loop."""
    torch.set_num_threads(1)
    # the host's default start method, for the DataLoader's own workers (a
    # worker the fork server started has the fork server's: its workers then
    # started a fork server of their own, importing PyTorch again, 2.5 s)
    multiprocessing.set_start_method(settings["start_method"], force=True)
    logging.getLogger("poptorchsim").debug("AsynchronousDataAccessor worker process: %d",
                                           os.getpid())    # PopTorch's line
    try:
        if isinstance(dataset, str):
            with open(dataset, "rb") as f:
                dataset = pickle.load(f)
        producer = _Producer(dataset, commands, data, settings)
        try:
            first = next(producer.iterator)
        except StopIteration:
            _fail(commands, data, "The Dataset is empty")
            return
        data.put(("ready",))
        producer.run(first)
    except KeyboardInterrupt:
        pass
    except Exception as exc:  # noqa: BLE001 - sent to the host, which raises it
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        _fail(commands, data, f"An error occurred in the data fetcher: {text}\n"
                              + traceback.format_exc())


def _fail(commands, data, text):
    """Sends the error, then stays alive until the host has read the items
    queued before it (their tensors' shared memory is handed over by this
    process) and asks it to shut down."""
    data.put((0, "error", text))
    try:
        while commands.get()[0] != "shutdown":
            pass
    except (EOFError, OSError):         # the host is gone
        pass
