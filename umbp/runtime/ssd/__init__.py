"""The SSD tier behind `umbp serve`: `tier` (SsdTier: slot index, eviction, checksummed
reads), `index` (what a crash leaves behind, rebuilt at open), `format` (superblock,
header records, slot layout), `file` (safe open, preallocation, whole I/O) and `stats`."""
