"""Step-time prediction: calibrate where it runs, price a traced step (docs/planning.md)."""
