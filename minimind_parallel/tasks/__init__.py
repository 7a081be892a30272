"""Tasks the command line runs on every rank: validate, benchmark."""
