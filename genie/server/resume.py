"""The worker's side of a resumable session: what it counts and records so a dropped link loses nothing.

A session that can be resumed (:mod:`genie.wire.resume`) sees its channel through a
:class:`ResumeLink`, which the executor sends and receives with. It keeps

- the count of BATCH frames received whole (:attr:`ResumeLink.batches`, with the native runner's, which
  reads frames itself): each ran exactly once, and a resume starts from this count. A batch whose
  upload payload did not arrive whole when the link dropped did not run, and is not counted
  (:meth:`ResumeLink.dropped_in_batch`);
- the last REPLY frame sent and the batch it answered (:attr:`ResumeLink.record`), until the next
  frame arrives (the client reads a reply before it sends anything more, so the next frame
  acknowledges it): a reply lost in the drop is sent again from here, never run again. A reply of more
  than :data:`MAX_RECORDED_BYTES` is not kept; losing one of those in a drop ends the session.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from genie.transport.base import Buffer, Channel

log = logging.getLogger("genie.server")

#: The longest REPLY frame kept for a resend (a FETCH reply carries the tensor's bytes).
MAX_RECORDED_BYTES = 64 << 20


class ResumeLink:
    """The session's channel as its executor uses it, keeping the counts and the record described above.

    Every attribute it does not define is the current channel's; :meth:`attach` swaps the channel after
    a resume.
    """

    def __init__(self, channel: Channel, native: Any = None) -> None:
        self.channel = channel
        self._native = native  #: the native runner (genie._C_plans.Runner), which counts the frames it reads
        self._python_batches = 0
        self.record: tuple[int, bytes] | None = None  #: (batch number, the REPLY frame) or None
        self._payload_left = 0  #: payload bytes of the batch being run not received yet

    def __getattr__(self, name: str) -> Any:
        return getattr(self.channel, name)

    @property
    def batches(self) -> int:
        """BATCH frames received whole in this session (by Python and by the native runner)."""
        return self._python_batches + (self._native.served() if self._native is not None else 0)

    def attach(self, channel: Channel) -> None:
        """Serve the resumed connection ``channel`` from now on."""
        self.channel = channel

    # -- the session loop's notes ------------------------------------------------------------

    def batch_read(self, payload_len: int) -> None:
        """Python read a BATCH header and body; ``payload_len`` bytes of uploads follow (received as it runs)."""
        self._python_batches += 1
        self._payload_left = payload_len
        self.record = None

    def native_served(self) -> None:
        """The native runner returned: a reply it sent itself becomes the record (none: a new frame came)."""
        if self._native is None:
            return
        reply = self._native.take_reply()
        if reply is not None:
            self.record = (self.batches, bytes(reply))

    def frame_read(self) -> None:
        """A frame other than BATCH came (ECHO): the last reply was read by the client."""
        self.record = None

    def dropped_in_batch(self) -> None:
        """The link dropped while a batch Python counted ran: if its uploads had not all arrived, it never
        ran (uploads come first), so it is not counted and the client sends it again."""
        if self._payload_left > 0:
            self._python_batches -= 1
        self._payload_left = 0

    def batch_done(self) -> None:
        self._payload_left = 0

    # -- what the executor calls ---------------------------------------------------------------

    def recv_into(self, view: memoryview) -> None:
        self.channel.recv_into(view)
        if self._payload_left:
            self._payload_left = max(0, self._payload_left - view.nbytes)

    def sendv_part(self, buffers: Sequence[Buffer]) -> None:
        """Send part of a reply sent in parts (a chunked download, larger than :data:`MAX_RECORDED_BYTES`): no
        record is kept of it, as of any reply that large."""
        self.record = None
        self.channel.sendv(buffers)

    def sendv(self, buffers: Sequence[Buffer]) -> None:
        try:
            self.channel.sendv(buffers)
        finally:
            # Kept after the send (the views are valid until the executor's send returns): the copy is off
            # the client's path. Kept even when the send failed: that is when it is needed.
            views = [memoryview(b) for b in buffers]
            size = sum(v.nbytes for v in views)
            if size <= MAX_RECORDED_BYTES:
                self.record = (self.batches, b"".join(views))
            else:
                self.record = None
                log.debug("a reply of %d bytes is not kept for a resend (MAX_RECORDED_BYTES)", size)
