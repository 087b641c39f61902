import sys

try:
    from dipoorlet.cli import main  # imports no numpy: main() sets the MPI thread share first

    code = main()
except KeyboardInterrupt:
    # Ctrl-C before the run's own handler is in place (while the CLI's modules load, ~0.3 s):
    # one line, as later, not a traceback; nothing has been written yet (under mpirun, which
    # passes Ctrl-C to every rank, the launcher's rank 0 says it)
    from dipoorlet.threads import abort_launch, say_stopped

    say_stopped("dipoorlet: interrupted; no output was written")
    abort_launch(130)
    code = 130
raise SystemExit(code)
