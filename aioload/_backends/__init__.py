"""Where workers run, behind one seam (``base.WorkerBackend``): local processes, the calling
process, Ray actors, and a scripted fake that drives the engine's tests."""
