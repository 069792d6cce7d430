"""A run's life: where each process runs and the ranks' agreement on everything, start-up, the epoch rows and
results, the state saved and resumed.

    launch        where a process runs, and every rank's agreement on options, device, precision and data
    records       the run's configuration and its epoch rows
    resume        the run's state saved at epochs' and windows' ends, resumed bit for bit; SIGTERM as a stop
"""
