"""Word-level LSTM language modelling (the seeds' LSTM benchmarks); the King James Bible installs offline."""
