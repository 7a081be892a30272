"""Profiles of communication overlap: traces, the overlap report, timelines.

    trace     profile_steps(): a few train steps under torch.profiler, one trace per rank
    overlap   the overlap report computed from a trace (interval arithmetic, no torch)
    timeline  a PNG of one step per rank: compute and communication lanes

The ranges they read are opened by the library itself (`distributed.ranges.span`); nothing in
the core imports this package. Deliberately empty of imports.
"""
