"""A slot's Redis/Valkey stream (docs/fleet.md): its entry format, the writer beside each slot, and the reader
that rebuilds any number of slots from their streams with no agent connection."""
