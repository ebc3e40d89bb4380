"""The output store: sample files in a trainer's format, an index, a manifest, atomic commits."""
