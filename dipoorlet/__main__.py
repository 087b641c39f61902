from dipoorlet.cli import main

raise SystemExit(main())
