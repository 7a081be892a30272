"""Profiles of communication overlap (SPEC 6): traces, the overlap report, timelines.

    ranges    named record_function ranges the library opens (free when not profiling)
    trace     profile_steps(): a few train steps under torch.profiler, one trace per rank
    overlap   the overlap report computed from a trace (interval arithmetic, no torch)
    timeline  a PNG of one step per rank: compute and communication lanes

Deliberately empty of imports: the library's layers import `ranges` on every run.
"""
