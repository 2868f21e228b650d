"""Small helpers shared by every package; they import no selfspec package (errors.py aside), so any package may use
them: io (atomic writes, checksums, locks, safe path names), tensors, paths (conf/ and the cache), config (typed
configs from Hydra nodes), markdown (tables), timing (clocks and the interleaved timing harness), logger (W&B or
nothing), sweeps (a sweep dir's job results)."""
