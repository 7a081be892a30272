"""Communication every parallelism shares, in one neutral place (the core imports it; nothing
here imports the harness):

    comm     every collective and point-to-point transfer of the library, each inside the
             `collective(kind)` marker that profilers and the memory tracker observe
    ranges   `span(name)`: a named profiler range, free when no profiler records
    loaded_types  `is_dtensor`, `is_fsdp_module`: isinstance checks that import neither class
"""
