"""Event-loop helpers: waiting without blocking, the sync front end's private loop, lazy imports."""
