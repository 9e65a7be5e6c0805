"""The process ``stage="auto"`` traces in: ``python -m zeroshard.timing.trace_child``.

[Note: a child that imports nothing of the script]
A trace needs a process without a default process group (it makes a fake one), so the
ranks trace in a child. multiprocessing's "spawn" and "forkserver" children import the
script that runs as ``__main__`` (to find functions pickled by reference): a torchrun
script without an ``if __name__ == "__main__":`` guard — as most training scripts and our
own docs' snippets are — ran its top level again in the child, joined the job as a second
rank of the same number, and died after minutes with multiprocessing's bootstrapping
error (a new user's trial). This child is a plain interpreter running this module: it
imports what the pickled model and loss function name, nothing else, and starts without
torchrun's variables. Messages are length-prefixed pickles on stdin/stdout: a list of
(twin model, jobs) requests in, a list of results (or a failure's text) out; EOF ends it.
"""

from __future__ import annotations

import pickle
import struct
import sys
from typing import Any, BinaryIO

#: torchrun's variables: a child that saw them would take itself for a rank.
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
                "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
                "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def write(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def read(stream: BinaryIO) -> Any:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError
    (n,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(n))


def main() -> None:
    from zeroshard.memory.traced import TraceError, trace_step

    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # prints of the traced code must not corrupt the replies
    while True:
        try:
            request = read(sys.stdin.buffer)
        except EOFError:
            return
        except Exception as exc:  # a model or loss function this process cannot import
            write(out, ("unpickle", f"{type(exc).__name__}: {exc}"))
            continue
        twin, jobs = request
        results: list[Any] = []
        for job in jobs:
            try:
                results.append(trace_step(twin, subprocess=False, **job))
            except TraceError as exc:
                results.append(str(exc))
        write(out, ("ok", results))


if __name__ == "__main__":
    main()
