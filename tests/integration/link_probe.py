"""The attacker's tools for the escape suite's probes of the live link between the REPL's
interpreter and its supervisor (repl_main.py: a socketpair; frames of a 4-byte big-endian length
and one JSON object), and the host's check that a probe aimed at that link.

The driver's own Channel objects are no guide: the interpreter is forked from the supervisor, so
gc also finds the supervisor's host channel in it, whose descriptors were closed at the fork (a
probe writing there writes to nothing, or to whatever file reuses the number). `find_link` takes
the one socket the interpreter holds, checks it against the driver's channels and asks the kernel
who is at the other end; `reached_link` then fails a test whose probe aimed anywhere else.
"""

from __future__ import annotations

import json
from typing import Any

# Cell code (run before a probe's own). `find_link` prints the evidence `reached_link` checks.
PRELUDE = r'''
import fcntl, gc, json, os, socket, stat, struct, sys, termios, time

def find_link():
    """This interpreter's end of its link to the supervisor, found as an attacker would."""
    sockets = []
    for name in os.listdir('/proc/self/fd'):
        try:
            if stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                sockets.append(int(name))
        except OSError:  # the listing's own descriptor, closed by now
            pass
    channels = sorted({o.fd_in for o in gc.get_objects() if type(o).__name__ == 'Channel'})
    peer = -1
    if len(sockets) == 1:  # whose end the other one is: the kernel's record of its creator
        other = socket.socket(fileno=os.dup(sockets[0]))
        peer = struct.unpack('3i', other.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        other.close()
    evidence = {'sockets': sockets, 'channels': channels, 'peer': peer, 'parent': os.getppid()}
    print('LINK ' + json.dumps(evidence), flush=True)
    return sockets[0] if sockets else -1

def cell_id():
    """The running cell's id, from the driver's frame that runs it (its `request`)."""
    frame = sys._getframe()
    while not isinstance(frame.f_locals.get('request'), dict):
        frame = frame.f_back
    return frame.f_locals['request']['id']

def frame(message):
    payload = message if isinstance(message, bytes) else json.dumps(message).encode()
    return struct.pack('>I', len(payload)) + payload

def send(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]

def receive(fd):
    """One frame from the link (the reply the supervisor meant for the driver)."""
    def exactly(size):
        data = b''
        while len(data) < size:
            data += os.read(fd, size - len(data))
        return data
    return json.loads(exactly(struct.unpack('>I', exactly(4))[0]))

def taken(fd):
    """Until the supervisor has read every byte written to the link (none left queued)."""
    queued = bytearray(4)
    while True:
        fcntl.ioctl(fd, termios.TIOCOUTQ, queued)
        if not int.from_bytes(queued, sys.byteorder):
            return
        time.sleep(0.005)

fd = find_link()
'''


def probe(attack: str) -> str:
    """Cell code: the prelude (which finds the link as `fd`), then the attack."""
    return PRELUDE + attack


def reached_link(output: str) -> dict[str, Any]:
    """The evidence a probe printed, checked: it aimed at the interpreter's only socket, a
    channel of the driver's, whose other end is the supervisor (pid 1, the parent)."""
    lines = [line for line in output.splitlines() if line.startswith("LINK ")]
    assert lines, f"the probe printed no evidence of its link: {output!r}"
    link: dict[str, Any] = json.loads(lines[0].removeprefix("LINK "))
    assert len(link["sockets"]) == 1, link
    assert link["sockets"][0] in link["channels"], link
    assert link["peer"] == link["parent"] == 1, link
    return link
