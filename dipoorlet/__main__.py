import sys

try:
    from dipoorlet.cli import main  # imports no numpy: main() sets the MPI thread share first

    code = main()
except KeyboardInterrupt:
    # Ctrl-C before the run's own handler is in place (while the CLI's modules load, ~0.3 s):
    # one line, as later, not a traceback; nothing has been written yet (under mpirun, which
    # passes Ctrl-C to every rank, the launcher's rank 0 says it)
    from dipoorlet.threads import abort_launch, launcher_rank

    if launcher_rank() == 0:
        print("dipoorlet: interrupted; no output was written", file=sys.stderr, flush=True)
    else:
        # another rank: where mpirun passed Ctrl-C to every rank, rank 0's abort ends this wait;
        # a signal to this rank alone had ended the job on mpich's Abort line without a word
        import time

        try:
            time.sleep(2.0)
        except BaseException:  # noqa: BLE001 - a second Ctrl-C: said all the same
            pass
        print(f"dipoorlet: rank {launcher_rank()}: interrupted; no output was written", file=sys.stderr, flush=True)
    abort_launch(130)
    code = 130
raise SystemExit(code)
