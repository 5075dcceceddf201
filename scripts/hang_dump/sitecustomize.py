"""Stack dumps of a hung run, in every Python process it starts (spawned TP ranks too):

    PYTHONPATH=scripts/hang_dump:. OASIS_HANG_S=120 python3 scripts/gpu_tp_check.py

After OASIS_HANG_S seconds each process prints all its threads' stacks and exits. faulthandler
writes from its own thread, so this works where a signal would not: a main thread blocked in C
(an NCCL teardown, a CUDA synchronize). Found the TP teardown hang of 2026-11-30."""
import faulthandler
import os
import sys

if os.environ.get("OASIS_HANG_S"):
    faulthandler.dump_traceback_later(float(os.environ["OASIS_HANG_S"]), exit=True, file=sys.stderr)
