"""What the benchmark and study scripts under tools/ share; the CLI imports none of it:
training runs launched and recorded as jobs (`jobs`) and accuracy measures (`accuracy`)."""
