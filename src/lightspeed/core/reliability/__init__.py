"""Runs that survive failures: staged saves committed atomically, node-local checkpoints, the newest complete
checkpoint, resharding to another world size, the process group (per-restart store prefix, heartbeat, timeouts),
named hangs, mid-epoch resumable sampling and the checks a checkpoint passes before anything is loaded."""
