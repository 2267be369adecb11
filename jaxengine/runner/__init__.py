"""Model runners: turn a SchedulerOutput into device work and return sampled tokens."""
