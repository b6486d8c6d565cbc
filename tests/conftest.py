"""Settings for every test process and the processes it starts."""

import os

# Processes that initialise MPI without mpirun (transport="mpi" under torchrun or the test
# launcher: MPI singletons) run it in isolated mode, without starting Open MPI's daemon: several
# singletons starting at once on a loaded machine failed now and then with "Unable to start a
# daemon on the local node" before any of gradsparse ran. Under mpirun the setting does nothing.
os.environ.setdefault("OMPI_MCA_ess_singleton_isolated", "1")
