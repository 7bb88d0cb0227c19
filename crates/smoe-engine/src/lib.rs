//! smoe engine.
