"""What runs inside a worker, whichever backend hosts it: info, the step, fetch, stacking."""
