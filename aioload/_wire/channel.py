"""Framed messages over one AF_UNIX stream socket per worker.

Each frame is a 4-byte little-endian length followed by a pickle. A frame may carry file
descriptors (the memfd behind a new shared-memory slab) as SCM_RIGHTS ancillary data attached to
its first byte; the receiver queues them in arrival order, and the frame that announces a new
slab pops them from that queue.

The two ends are used differently:

* The worker end is blocking: a worker has nothing else to do while it waits. Its reads that
  must not wait say so per call (MSG_DONTWAIT), so the socket never changes mode.
* The parent end is non-blocking and never waits: ``pump_in`` reads whatever the kernel already
  holds, ``pump_out`` writes whatever fits. The orchestrator awaits readiness through one
  selector (see ``_backends/process.py``), so no read or write can stall the event loop, and a read cut
  short by cancellation leaves its bytes in ``inbox`` for the next call.
"""

from __future__ import annotations

import array
import io
import mmap
import os
import pickle
import socket
import struct
from collections import deque
from collections.abc import Callable
from typing import Any

_HEADER = struct.Struct("<I")
_MAX_FRAME = (1 << 32) - 1
# One recvmsg() reads at most this much; larger frames arrive over several calls. The bound also
# caps how long a single read can hold the event loop.
_READ_CHUNK = 1 << 20
# Room for the descriptors that can ride on one read.
_MAX_FDS_PER_READ = 64
_ANC_SPACE = socket.CMSG_SPACE(_MAX_FDS_PER_READ * array.array("i").itemsize)
# In ``ParentChannel.fds``, where a frame's descriptors should be but did not arrive.
LOST = -1
# ``recvmsg``'s flag as a plain int: ``socket.MSG_CTRUNC`` is an ``IntFlag``, and ``flags &``
# it makes a new enum member through ``enum``'s Python code, about 15K instructions: a tenth
# of what the parent spent per batch, for a bit that is almost never set.
_CTRUNC = int(socket.MSG_CTRUNC)


def _read_buffer() -> memoryview:
    """A ``_READ_CHUNK``-byte buffer for reads, resident only where reads have written.

    ``bytearray(n)`` zero-fills, so every one of its pages would be resident at once: 1 MiB per
    channel in the parent, the same again in every worker that a fork copies it into, and 1 MiB
    in each worker for its own end, while frames are usually a few hundred bytes. A private
    anonymous mapping is zero without being written, so only the pages that reads reach (the
    largest frame so far) count.
    """
    return memoryview(mmap.mmap(-1, _READ_CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))


class ChannelClosed(Exception):
    """The peer closed its end (for a worker: the worker exited or died)."""


# The classes a frame names (``aioload._wire.messages.Reply``, ``torch.float32``...), looked up once
# per process. pickle's own lookup goes through ``__import__`` for every global of every frame:
# for a small batch's answer, which names three, that was up to half of its unpickling
# (docs/benchmark-notes.md, "The wire's small costs").
_classes: dict[tuple[str, str], Any] = {}


class CachedUnpickler(pickle.Unpickler):
    """An Unpickler whose global lookups are cached (see ``_classes``)."""

    def find_class(self, module: str, name: str) -> Any:
        found = _classes.get((module, name))
        if found is None:
            found = _classes[(module, name)] = super().find_class(module, name)
        return found


def load_frame(payload: bytes | memoryview) -> Any:
    """One frame's message (pickle.loads, with cached class lookups)."""
    return CachedUnpickler(io.BytesIO(payload)).load()


# A frame is a pickle, which starts with pickle's PROTO opcode, or a message packed by the
# channel's ``pack`` (aioload._wire.packed: the reply most batches get, every task and every list of
# freed slabs), which starts with any other byte and is read back by the receiving channel's
# ``unpack``.
_PICKLE_PROTO = pickle.PROTO[0]
Pack = Callable[[Any], "bytes | None"]
Unpack = Callable[[memoryview], Any]


def encode_frame(message: Any, pack: Pack | None = None) -> bytes:
    """``message``'s frame: packed by ``pack`` where it packs it, else pickled."""
    payload = None if pack is None else pack(message)
    if payload is None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(payload) > _MAX_FRAME:
        raise ValueError(f"aioload frame of {len(payload)} bytes exceeds the 4 GiB limit")
    return _HEADER.pack(len(payload)) + payload


class _Channel:
    """What both ends of a worker's socket share: the socket, how its frames are packed and
    read back, and the buffers its reads land in."""

    # How a pickled frame is read back (see ParentChannel and WorkerChannel).
    _loads: Callable[[memoryview], Any]

    def __init__(
        self, sock: socket.socket, pack: Pack | None, unpack: Unpack | None, *, blocking: bool
    ) -> None:
        sock.setblocking(blocking)
        self.sock = sock
        self.pack = pack
        self.unpack = unpack
        self.inbox = bytearray()
        # Reads land in this buffer, made once. ``recvmsg(n)`` would allocate a fresh n-byte
        # object per call, which for 1 MiB means an mmap and a munmap per batch.
        self._chunk = _read_buffer()

    def _message(self, frame: memoryview) -> Any:
        """One frame's message: packed by the other end's ``pack`` (the common tasks and
        replies) or pickled."""
        if frame[0] != _PICKLE_PROTO and self.unpack is not None:
            return self.unpack(frame)
        return self._loads(frame)


class ParentChannel(_Channel):
    """The parent's non-blocking end of one worker's socket."""

    # Pickled answers name classes that the cache finds again (see _classes).
    _loads = staticmethod(load_frame)

    def __init__(
        self, sock: socket.socket, unpack: Unpack | None = None, pack: Pack | None = None
    ) -> None:
        super().__init__(sock, pack, unpack, blocking=False)
        self.outbox = bytearray()
        self.fds: deque[int] = deque()
        self.closed = False
        # Bytes the last pump_in read (the pool's waits use it: _backends.process._AWAIT_ONE_MAX_READ).
        self.last_read = 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def queue(self, message: Any) -> None:
        self.outbox += encode_frame(message, self.pack)

    def pump_out(self) -> None:
        """Write as much of the outbox as the socket takes now."""
        while self.outbox and not self.closed:
            try:
                sent = self.sock.send(self.outbox)
            except (BlockingIOError, InterruptedError):
                return
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise ChannelClosed from exc
            del self.outbox[:sent]

    def pump_in(self, budget: int = 8 * _READ_CHUNK) -> list[Any]:
        """Read what is buffered in the kernel (up to ``budget`` bytes) and return whole frames.

        Raises ChannelClosed once the peer has closed and every complete frame it sent before
        closing has been returned.
        """
        eof = False
        read = 0
        while read < budget:
            try:
                nbytes, ancdata, flags, _addr = self.sock.recvmsg_into([self._chunk], _ANC_SPACE)
            except (BlockingIOError, InterruptedError):
                break
            except ConnectionResetError:
                eof = True
                break
            if ancdata or flags & _CTRUNC:
                self._take_in_fds(ancdata, flags)
            if not nbytes:
                eof = True
                break
            self.inbox += self._chunk[:nbytes]
            read += nbytes
            if nbytes < len(self._chunk) and not ancdata and not flags & _CTRUNC:
                # A short read took everything the socket held: another recvmsg would only
                # fail with EAGAIN (a syscall and an exception per poll). A read that carried
                # descriptors may have stopped at them, with more behind: that one reads on.
                # Whatever arrives later wakes the selector again.
                break
        self.last_read = read
        frames = self._split()
        # Frames that arrived before the close are handed back first; the next call, reading
        # the closed socket again, finds no frame and raises.
        if eof and not frames:
            raise ChannelClosed
        return frames

    def _split(self) -> list[Any]:
        frames: list[Any] = []
        view = memoryview(self.inbox)
        pos = 0
        try:
            while len(view) - pos >= _HEADER.size:
                (size,) = _HEADER.unpack_from(view, pos)
                end = pos + _HEADER.size + size
                if end > len(view):
                    break
                with view[pos + _HEADER.size : end] as frame:
                    frames.append(self._message(frame))
                pos = end
        finally:
            view.release()
        if pos:
            del self.inbox[:pos]
        return frames

    def _take_in_fds(self, ancdata: list[tuple[int, int, bytes]], flags: int) -> None:
        """Queue the descriptors one read brought, or, where the kernel could not hand them
        over, a ``LOST`` marker in their place.

        A read stops after the data that carries descriptors (a unix socket never glues two
        sends' descriptors into one read), so what one read brings belongs to one frame: the
        next in the stream to announce a slab. With the descriptor table full (EMFILE) the
        kernel drops them and sets MSG_CTRUNC; the frame still comes. Without the marker that
        frame would pop nothing (or the next frame's descriptor, mapping the wrong slab); with
        it, it learns its slab never came (``take_fd`` returns None)."""
        fds = array.array("i")
        for level, kind, raw in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(raw[: len(raw) - (len(raw) % fds.itemsize)])
        if flags & _CTRUNC:
            # Part of a frame's descriptors is as useless as none: let go of what came.
            for fd in fds:
                os.close(fd)
            self.fds.append(LOST)
        else:
            self.fds.extend(fds)

    def take_fd(self) -> int | None:
        """The descriptor of the next frame that announces a slab; None where it was lost
        (the descriptor table was full when it arrived, see ``_take_in_fds``)."""
        if not self.fds:
            return None
        fd = self.fds.popleft()
        return None if fd == LOST else fd

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.sock.close()
        while self.fds:
            fd = self.fds.popleft()
            if fd != LOST:
                os.close(fd)


class WorkerChannel(_Channel):
    """The worker's blocking end of its socket."""

    # A worker's pickled frames are rare (a pass's Reset): pickle's own loads serves them.
    _loads = staticmethod(pickle.loads)

    def __init__(
        self, sock: socket.socket, pack: Pack | None = None, unpack: Unpack | None = None
    ) -> None:
        super().__init__(sock, pack, unpack, blocking=True)

    def send(self, message: Any, fds: list[int] | None = None) -> None:
        frame = encode_frame(message, self.pack)
        if fds:
            # The descriptors ride on the first byte of the frame.
            sent = self.sock.sendmsg(
                [frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
            )
            if sent < len(frame):
                self.sock.sendall(memoryview(frame)[sent:])
        else:
            self.sock.sendall(frame)

    def has_frame(self) -> bool:
        if len(self.inbox) < _HEADER.size:
            return False
        size: int = _HEADER.unpack_from(self.inbox, 0)[0]
        return len(self.inbox) >= _HEADER.size + size

    def fill(self, wait: bool) -> int:
        """Read what is available (blocking for at least one byte when ``wait``); the number of
        bytes read, 0 when nothing was there and ``wait`` is false.

        Raises ChannelClosed when the parent's end is gone.
        """
        # The socket stays blocking; a read that must not wait says so per call
        # (MSG_DONTWAIT). Switching the socket's mode instead costs two ioctl calls per read,
        # and a worker reads at least twice per batch.
        try:
            nbytes = self.sock.recv_into(self._chunk, 0, 0 if wait else socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return 0
        except ConnectionResetError as exc:
            raise ChannelClosed from exc
        if not nbytes:
            raise ChannelClosed
        self.inbox += self._chunk[:nbytes]
        return nbytes

    def pop(self) -> Any:
        (size,) = _HEADER.unpack_from(self.inbox, 0)
        end = _HEADER.size + size
        with memoryview(self.inbox)[_HEADER.size : end] as frame:
            message = self._message(frame)
        del self.inbox[:end]
        return message
