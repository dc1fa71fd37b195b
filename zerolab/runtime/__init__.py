"""The runtime every engine stands on: how ranks talk and how a run is watched.

* comm: the ledger every collective goes through (bytes, time, the recorder's entry);
* recorder: the flight recorder, each rank's last collectives in a file that outlives it;
* watchdog: the collective timeout, which names a rank that stopped answering;
* doctor: `python -m zerolab doctor`, which reads the recorder's files after a run parted;
* debug: first_nonfinite, the first module whose output is inf or nan.
"""
