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
