"""Platform specs shipped with dipoorlet (installed as ``dipoorlet.platforms``)."""
