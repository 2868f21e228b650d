"""Small helpers shared by every package (io: atomic writes, checksums, locks, safe path names)."""
