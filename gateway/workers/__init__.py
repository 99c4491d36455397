"""The device workers' lives: supervision and restarts, autoscaling, placement on Ray."""
