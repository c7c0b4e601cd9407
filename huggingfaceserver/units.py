"""Units of memory, written once for the whole package."""

MiB = 1 << 20
GiB = 1 << 30
