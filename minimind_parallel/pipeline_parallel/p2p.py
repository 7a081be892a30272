"""Point-to-point communication between neighbouring pipeline stages.

Forward sends activations downstream (stage p -> p+1), backward sends their grads upstream.
Both have the shape of the stage boundary: [S/T, B, H] under SP, else [S, B, H].

Every exchange is ONE `comm.send_recv` (a `dist.batch_isend_irecv`) of all the sends and receives this stage makes
at that point of the schedule, and then a wait on every work it returns (gloo gives one work
per op). Posting the send and the receive together is what keeps 1F1B's steady state
deadlock-free: stage p sends an activation forward while stage p+1 sends a grad backward, and
neither waits for its own send before its receive is posted. Directions never share a pair's
queue (activations only go down, grads only up), so matching is by order alone.
The first and last stage have no neighbour on one side: those calls are no-ops returning None.

Orders with model chunks or W steps (interleaved, zb) use `post_send` and `recv_posted`: the
neighbours wrap round (stage P-1's chunk c feeds stage 0's chunk c+1), so activations and grads
share a pair of ranks in both directions; each kind goes under its own tag, so each link (pair,
kind) matches by order alone, and a send is posted without waiting (order.simulate checks that
each link's messages are received in the order they are sent, and that no stage waits forever).
"""
from __future__ import annotations

import torch

from ..distributed import comm
from ..groups import ProcessGroups


def _exchange(groups: ProcessGroups, like: dict, *, send_next=None, send_prev=None, recv_prev=False,
              recv_next=False):
    """Post the given sends/receives as one batch and wait on all of them.
    like: torch.empty kwargs (size, dtype, device) of the boundary tensor. -> (from_prev, from_next)."""
    sends, recvs, from_prev, from_next = [], [], None, None
    if send_next is not None:
        sends.append((send_next, groups.next_rank))
    if send_prev is not None:
        sends.append((send_prev, groups.prev_rank))
    if recv_prev:
        from_prev = torch.empty(**like)
        recvs.append((from_prev, groups.prev_rank))
    if recv_next:
        from_next = torch.empty(**like)
        recvs.append((from_next, groups.next_rank))
    comm.send_recv(groups.pp, sends=sends, recvs=recvs)
    return from_prev, from_next


def recv_forward(groups: ProcessGroups, like: dict):
    """The previous stage's output activation (None on the first stage)."""
    if groups.is_first_stage:
        return None
    return _exchange(groups, like, recv_prev=True)[0]


def send_forward(x, groups: ProcessGroups) -> None:
    if not groups.is_last_stage:
        _exchange(groups, {}, send_next=x)


def recv_backward(groups: ProcessGroups, like: dict):
    """The grad of this stage's output, from the next stage (None on the last stage)."""
    if groups.is_last_stage:
        return None
    return _exchange(groups, like, recv_next=True)[1]


def send_backward(grad, groups: ProcessGroups) -> None:
    if not groups.is_first_stage:
        _exchange(groups, {}, send_prev=grad)


def send_forward_recv_backward(x, groups: ProcessGroups, like: dict):
    """1F1B steady state, after a forward: send its output, receive the grad of the oldest one."""
    if groups.is_last_stage:
        return None
    return _exchange(groups, like, send_next=x, recv_next=True)[1]


def send_backward_recv_forward(grad, groups: ProcessGroups, like: dict):
    """1F1B steady state, after a backward: send its input grad, receive the next activation."""
    if groups.is_first_stage:
        return None
    return _exchange(groups, like, send_prev=grad, recv_prev=True)[0]


ACTIVATION_TAG, GRAD_TAG = 1, 2


def _wrapped_peer(groups: ProcessGroups, step: int) -> int:
    """The stage `step` (+1 / -1) from this one, round the ring of the pipeline's ranks."""
    return groups.pp_ranks[(groups.pp_rank + step) % groups.par.pp]


def post_send(x, groups: ProcessGroups, *, forward: bool):
    """Post the send of an output activation to the next virtual stage (`forward`) or of an input
    grad to the previous one; -> its handle (wait() once done(), or to finish)."""
    peer = _wrapped_peer(groups, 1 if forward else -1)
    return comm.send_recv(groups.pp, sends=[(x, peer)], tag=ACTIVATION_TAG if forward else GRAD_TAG,
                          async_op=True, kind="send")


def recv_posted(groups: ProcessGroups, like: dict, *, forward: bool):
    """The input activation from the previous virtual stage (`forward`), or the grad of an output
    from the next one [S/T, b, H]."""
    buffer = torch.empty(**like)
    peer = _wrapped_peer(groups, -1 if forward else 1)
    comm.send_recv(groups.pp, recvs=[(buffer, peer)], tag=ACTIVATION_TAG if forward else GRAD_TAG, kind="recv")
    return buffer
