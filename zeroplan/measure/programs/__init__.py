"""Training programs measure runs as they are, instead of zeroplan's own loop (recipe plain):
one module per recipe, each called by the worker with the process group joined."""
