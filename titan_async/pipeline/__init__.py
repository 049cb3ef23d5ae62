"""Asynchronous (no-flush) pipeline schedules: PipeDream-2BW and PACI."""
