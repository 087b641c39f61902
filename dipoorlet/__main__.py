import sys

try:
    from dipoorlet.cli import main  # imports no numpy: main() sets the MPI thread share first

    code = main()
except KeyboardInterrupt as exc:
    # Ctrl-C before the run's own handler is in place (while the CLI's modules load, ~0.3 s), or
    # after it is gone (held while the run's log is closed, delivered as main() returns): one
    # line, as during the run, not a traceback (under mpirun, which passes Ctrl-C to every rank,
    # the launcher's rank 0 says it). What -O holds decides the line: a Ctrl-C delivered after
    # the outputs were written had been told "no output was written" (found by a hunt).
    from dipoorlet.threads import abort_launch, say_stopped

    cli = sys.modules.get("dipoorlet.cli")
    term = cli is not None and isinstance(exc, getattr(cli, "Terminated", ()))
    note = cli._stop_note() if cli is not None and hasattr(cli, "_stop_note") else "no output was written"
    code = 143 if term else 130
    say_stopped(f"dipoorlet: {'terminated (SIGTERM)' if term else 'interrupted'}; {note}")
    abort_launch(code)
raise SystemExit(code)
