"""Request snapshots and recovery: a killed engine's requests continue where they stopped (`snapshot`,
`journal`, `recorder`, `resume`). See docs/recovery.md."""
