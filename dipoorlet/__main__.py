from dipoorlet.cli import main  # imports no numpy: main() sets the MPI thread share first

raise SystemExit(main())
