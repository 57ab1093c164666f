"""The line an engine prints once it listens, and which its launcher waits for.

Its own module so that launchers (the cell agent, `gyre run`) can wait for an engine without
importing the engine, which imports torch (~1.7 CPU-s per process)."""

READY_MARKER = "GYRE_ENGINE_LISTENING"
