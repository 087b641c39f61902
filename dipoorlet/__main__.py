from dipoorlet.threads import share_cores

share_cores()          # before numpy and onnxruntime start their thread pools

from dipoorlet.cli import main  # noqa: E402

raise SystemExit(main())
