"""Core types shared by every layer: config, clock, registry, KV layout. Imports nothing from kvrelay."""
